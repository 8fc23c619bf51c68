// CRC-32C (Castagnoli): the checksum of the cluster's binary encodings (codec.h).
//
// The reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF, as iSCSI, ext4 and
// LevelDB use it: Crc32c("123456789") == 0xE3069283. The lookup tables (slicing by 8) are computed
// from the polynomial on first use, not copied.
//
// Thread-safety: pure functions (the tables are built once, thread-safely).
#ifndef ELDR_CLUSTER_CRC32C_H_
#define ELDR_CLUSTER_CRC32C_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace eldr::cluster {

// The CRC-32C of `crc`'s message followed by `bytes` (`crc` is a previous result; 0 for none), so
// Crc32cExtend(Crc32c(a), b) == Crc32c(a + b).
uint32_t Crc32cExtend(uint32_t crc, absl::string_view bytes);

inline uint32_t Crc32c(absl::string_view bytes) { return Crc32cExtend(0, bytes); }

}  // namespace eldr::cluster

#endif  // ELDR_CLUSTER_CRC32C_H_
