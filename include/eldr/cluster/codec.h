// The binary encodings the router replicas exchange through Redis: a centroid set (what the refit
// leader publishes) and a sampled signature of the shared refit window. Both are versioned,
// little-endian on every platform, and end with a CRC-32C of everything before it, so a truncated,
// corrupted or foreign value is refused with a reason instead of being installed.
//
// Centroid set, version 1 ("ELDC"):
//   offset 0   char[4]  magic "ELDC"
//          4   u32      version (1)
//          8   u32      total length in bytes, checksum included
//         12   i32      layers            16  i32  experts
//         20   u8       variant (0 count, 1 count_idf, 2 gate_prob), then 3 zero bytes
//         24   u32      layer mask entries (m), then m x i32 layer indices
//              u32      IDF weights (w), then w x f32
//              i32      k (rows)          i32  dim (== the spec's dimension)
//              k*dim x f32 centroid rows, row-major
//              u32      worker names (0 or k), each a u16 length and its bytes
//              u32      model name length, its bytes
//              u64      calibration seed
//              u32      CRC-32C of every byte above
//
// Window signature, version 1 ("ELDW"):
//   char[4] magic "ELDW", u8 version (1), u8 form, u16 zero, u32 dim, u32 n, then by form:
//     0 dense f32:   n == dim f32 values
//     1 sparse f32:  n x (u32 index, f32 value)
//     2 dense f16:   n == dim IEEE binary16 values
//     3 sparse f16:  n x (u16 index, binary16 value), only when dim <= 65536
//   (sparse indices strictly increasing and < dim); f64 decode work; u32 CRC-32C of every byte
//   above. The encoder picks the smallest form: half precision whenever every value fits it (a
//   unit signature always does; relative rounding error at most 2^-11, which the refit's k-means
//   does not notice), sparse when a prompt touches less than half of the experts. A 48 x 128
//   signature takes at most 12.3 KB instead of 24.6 KB in fp32.
//
// Thread-safety: pure functions.
#ifndef ELDR_CLUSTER_CODEC_H_
#define ELDR_CLUSTER_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "eldr/core/centroid_artifact.h"

namespace eldr::cluster {

inline constexpr uint32_t kCentroidEncodingVersion = 1;
inline constexpr uint32_t kSignatureEncodingVersion = 1;
// Largest encoded centroid set accepted (Redis's own limit for a string is 512 MiB).
inline constexpr size_t kMaxEncodedCentroidBytes = size_t{256} << 20;

// Validates (ValidateCentroidArtifact) and encodes. INVALID_ARGUMENT for an invalid artifact, a
// worker name over 65535 bytes, or an encoding over kMaxEncodedCentroidBytes.
absl::StatusOr<std::string> EncodeCentroidArtifact(const CentroidArtifact& artifact);

// Decodes and validates. Errors name what is wrong:
//  - DATA_LOSS: not an encoding (magic), truncated or over-long (length field), checksum mismatch,
//    a field running past the end, trailing bytes;
//  - UNIMPLEMENTED: a version this build does not know (a newer replica published it);
//  - INVALID_ARGUMENT: well-formed, but ValidateCentroidArtifact refuses the artifact (or dim does
//    not match the spec).
absl::StatusOr<CentroidArtifact> DecodeCentroidArtifact(absl::string_view bytes);

// One sampled signature of the shared refit window.
struct WindowSignature {
  std::vector<float> signature;  // the transformed (unit) signature
  // The request's decode work once known (e.g. its output tokens); 0 when not known yet.
  double decode_work = 0;
  std::string client;  // RouteInput::client of the request (fair-share accounting); may be empty
};

// The signature and decode work of `entry` (the client travels beside it, as a stream field).
// INVALID_ARGUMENT for an empty signature, more than 2^24 values, or non-finite values.
absl::StatusOr<std::string> EncodeWindowSignature(const WindowSignature& entry);
// Fills signature and decode_work (client is left empty). DATA_LOSS / UNIMPLEMENTED as above;
// INVALID_ARGUMENT for non-finite values.
absl::StatusOr<WindowSignature> DecodeWindowSignature(absl::string_view bytes);

}  // namespace eldr::cluster

#endif  // ELDR_CLUSTER_CODEC_H_
