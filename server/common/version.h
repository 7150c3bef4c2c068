#pragma once
// muond's version, as the servers report it (muond_build_info). The same
// string as the Python package's client/python/muond/_version.py (its one
// home; tests/server/common/version_test.py checks they are equal): bump both.

namespace muond {

inline constexpr char kMuondVersion[] = "0.21.0";

}  // namespace muond
