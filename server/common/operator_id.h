#pragma once
// The operator's identity on SaveState/LoadState/UnregisterParams
// (docs/ARCHITECTURE.md "Security and state"). The owner of the params (the
// client_id that registered them) and the operator may save and load a
// daemon's state, and the operator may unregister a trainer that is gone.
//
// The operator's client_id is derived from the daemon's token, so only a
// holder of the token can act as the operator: a trainer that learns another
// trainer's client_id still cannot present the operator's without the token.
// A daemon without a token (a Unix socket, 0600 in a 0700 directory of its
// user) derives it from the empty token, a public value: there the socket's
// mode is what keeps other users out, and every process of the user may act
// as the operator. The id is a credential: never put it in a message.
#include <string>

#include "absl/strings/string_view.h"

namespace muond {

// "operator:" + the lowercase hex HMAC-SHA256 of kOperatorIdLabel keyed with
// the token (muond/client.py operator_client_id computes the same).
inline constexpr char kOperatorIdPrefix[] = "operator:";
inline constexpr char kOperatorIdLabel[] = "muond operator client_id v1";

std::string OperatorClientId(absl::string_view token);

}  // namespace muond
