// The slots a fused pass first hits in a table (hps/csrc/fused_lookup.cpp). Included by it.
#pragma once

#include <cassert>
#include <cstdint>
#include <memory>

namespace hps_cpu {

// The slots first hit in a call, whose mark bits are cleared after its uses: room for every
// key of the table is made before the pass, so recording one is a store (no growth check or
// out-of-line push_back on the per-key path).
struct FirstHits {
  std::unique_ptr<int64_t[]> slots;
  int64_t n = 0, room = 0;
  void make_room(int64_t keys) {  // before the pass, while empty: n == 0 (the old slots go)
    assert(n == 0);
    if (keys > room) {
      slots.reset(new int64_t[keys]);
      room = keys;
    }
  }
  void add(int64_t s) { slots[n++] = s; }
};

}  // namespace hps_cpu
