#pragma once
// Grouping that every rank does alike: the step groups its groups by
// communicator, NS runner or NS options, and the groups' order decides the
// order of collectives and of memory, so it must follow the input order.
#include <cstddef>
#include <vector>

namespace muond {

// The indices i in [0, n) with keep(i), grouped so that i joins the first
// group whose first index f has same(f, i); groups in order of their first
// index, each group's indices ascending.
template <typename Keep, typename Same>
std::vector<std::vector<size_t>> GroupInOrder(size_t n, Keep keep, Same same) {
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < n; ++i) {
    if (!keep(i)) continue;
    bool placed = false;
    for (std::vector<size_t>& group : groups) {
      if (same(group.front(), i)) {
        group.push_back(i);
        placed = true;
        break;
      }
    }
    if (!placed) groups.push_back({i});
  }
  return groups;
}

}  // namespace muond
