#pragma once
// The naming rule between the wire's option enums and the core's: a wire
// value is its enum's prefix (the name of value 0 without "UNSPECIFIED")
// followed by the core name in upper case (SCALE_MODE_SHAPE_SCALING =
// "shape_scaling"). The core's Parse*/ *Name functions keep the one list of
// names; these templates only apply the rule (proto_convert,
// proto_convert_options). muond.wire_enums applies it in Python.
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"

namespace muond::wire_enum {

using google::protobuf::EnumDescriptor;
using google::protobuf::EnumValueDescriptor;

// "SCALE_MODE_" for ScaleMode: the name of value 0 without "UNSPECIFIED".
inline std::string WirePrefix(const EnumDescriptor& wire) {
  std::string prefix = wire.value(0)->name();
  prefix.resize(prefix.size() - std::string_view("UNSPECIFIED").size());
  return prefix;
}

// Wire value -> core value by the naming rule: strip the prefix, lower-case,
// and let the core parser (the one list of names) decide.
template <typename Core>
absl::StatusOr<Core> CoreFromWire(
    const EnumDescriptor& wire, int number, std::string_view field,
    absl::StatusOr<Core> (*parse)(std::string_view)) {
  const EnumValueDescriptor* value = wire.FindValueByNumber(number);
  if (value == nullptr || number == 0) {
    std::vector<std::string> names;
    for (int i = 1; i < wire.value_count(); ++i) {
      names.push_back(wire.value(i)->name());
    }
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(field), ": ",
                     value ? value->name() : absl::StrCat("value ", number),
                     " is not one of ", absl::StrJoin(names, ", ")));
  }
  const std::string prefix = WirePrefix(wire);
  absl::StatusOr<Core> core =
      parse(absl::AsciiStrToLower(value->name().substr(prefix.size())));
  if (!core.ok()) {
    return absl::InternalError(absl::StrCat(std::string(field), ": wire value ",
                                            value->name(),
                                            " has no core value of that name"));
  }
  return core;
}

template <typename Wire>
Wire WireFromCore(const EnumDescriptor& wire, std::string_view core_name) {
  const EnumValueDescriptor* value = wire.FindValueByName(absl::StrCat(
      WirePrefix(wire), absl::AsciiStrToUpper(std::string(core_name))));
  return Wire(value ? value->number() : 0);
}

}  // namespace muond::wire_enum
