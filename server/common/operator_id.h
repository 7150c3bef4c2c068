#pragma once
// The operator's identity on SaveState/LoadState (docs/ARCHITECTURE.md
// "Security and state"). The owner of the params (the client_id that
// registered them) and the operator may save and load a daemon's state;
// muonctl, which does not know the trainer's client_id, sends this one.
// client_id is a guard against another trainer's connection, not
// authentication: the transport authenticates (the 0600 Unix socket, the
// token or TLS), and anyone who passes it may act as the operator.
namespace muond {

inline constexpr char kOperatorClientId[] = "muonctl:operator";

}  // namespace muond
