// The distinct slots a fused pass hits in a table, and the per-thread slot bitmap that finds
// them (hps/csrc/fused_lookup.cpp, hps/csrc/static_gather.h). Included by both.
#pragma once

#include <cassert>
#include <cstdint>
#include <memory>
#include <vector>

namespace hps_cpu {

// The slots a fused pass hits in a table, each recorded once (its unique hits): one bit per
// slot of the cache (this thread's slot_bits, all zero between tables) says whether a slot
// was hit before in this call, and the slots first hit are listed so that exactly their
// words are cleared afterwards. The counters are never written for it, so a hit whose use
// does not change its level writes nothing. Room for every key of the table is made
// before the pass, so recording one is a store.
struct FirstHits {
  std::unique_ptr<int64_t[]> slots;
  int64_t n = 0, room = 0;
  uint64_t* bits = nullptr;  // capacity bits, all zero when a table's pass starts
  // before the pass, while empty (n == 0): room for `keys` slots, grown only when short (a
  // thread's kept FirstHits serve call after call); bits: the table's capacity bits
  void make_room(int64_t keys, uint64_t* slot_words) {
    assert(n == 0);
    if (keys > room) {
      slots.reset(new int64_t[keys]);
      room = keys;
    }
    bits = slot_words;
  }
  void see(int64_t s) {
    const uint64_t b = uint64_t{1} << (s & 63);
    uint64_t& w = bits[s >> 6];
    if (!(w & b)) {
      w |= b;
      slots[n++] = s;
    }
  }
  // Zero the bits this table set (whole words: only its slots set bits in them); returns
  // how many slots it hit.
  int64_t clear() {
    for (int64_t k = 0; k < n; ++k) bits[slots[k] >> 6] = 0;
    const int64_t m = n;
    n = 0;
    return m;
  }
};

// One bit per slot of the widest cache this thread has passed over (or per key of the widest
// dense key index whose distinct keys it counted, slot_uses.h), all zero between calls (each
// user clears what it set); per thread, so concurrent calls over the same caches never share
// it; capacity / 8 bytes, grown, never shrunk.
inline std::vector<uint64_t>& slot_bits(int64_t capacity) {
  thread_local std::vector<uint64_t> bits;
  const size_t words = static_cast<size_t>((capacity + 63) / 64);
  if (bits.size() < words) bits.resize(words, 0);
  return bits;
}

}  // namespace hps_cpu
