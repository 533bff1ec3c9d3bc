// Per-thread scratch buffers reused by every work item and call of the CPU decode kernel. A decode step runs
// ~100 (sequence, head) items a layer, each with a few small buffers; allocated and freed per item (aligned
// new / delete), they cost more than the attention itself at short contexts (MHA, batch 8, 1 cached key).
#pragma once

#include <cstddef>
#include <cstring>
#include <vector>

namespace kvlm_decode {

constexpr int kCallSlot = 8;  // slots [0, 8): a work item's (attend_range); [8, 13): a call's, on its thread
constexpr int kScratchSlots = 13;
constexpr size_t kScratchKeepBytes = size_t(1) << 20;  // a buffer past this is freed by the next smaller request

// `bytes` of 64-byte-aligned memory for buffer `slot` of the calling thread, zeroed unless `zero` is false (a
// buffer its user writes whole before reading: zeroing every buffer touched ~200 KB a call at MLA's batch 8),
// valid until this thread asks for the same slot again. Each buffer grows to the largest request and is kept for
// the thread's life, up to kScratchKeepBytes: a larger one (a prefill-sized call of many query rows) lasts until
// a smaller request.
inline void* scratch(int slot, size_t bytes, bool zero = true) {
  struct alignas(64) Block {
    unsigned char b[64];
  };
  thread_local std::vector<Block> buffers[kScratchSlots];
  std::vector<Block>& buf = buffers[slot];
  const size_t blocks = (bytes + 63) / 64, keep = kScratchKeepBytes / 64;
  if (buf.size() > keep && blocks <= keep) std::vector<Block>(blocks).swap(buf);
  if (buf.size() < blocks) buf.resize(blocks);
  if (zero) std::memset(buf.data(), 0, blocks * 64);
  return buf.data();
}

// n elements of type E (trivial, alignment <= 64) in scratch slot `slot`, zeroed unless `zero` is false.
template <typename E>
inline E* scratch_array(int slot, size_t n, bool zero = true) {
  static_assert(alignof(E) <= 64, "scratch is 64-byte aligned");
  return static_cast<E*>(scratch(slot, n * sizeof(E), zero));
}

}  // namespace kvlm_decode
