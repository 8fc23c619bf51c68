/*
 * ELDR capture library, C ABI (libeldr_capture.so).
 *
 * A prefill engine calls this library from its MoE layers to count, for every request, how many prompt
 * tokens chose each routed expert of each MoE layer: the request's expert counts [L][E], which the
 * router turns into the request's expert signature (docs/capture.md).
 *
 * Counts are kept per physical KV block, co-indexed with the engine's paged KV cache:
 * counts[num_blocks][L][E]. A request's counts are the sum over the blocks of its block table, so
 * blocks served from the prefix cache contribute exactly the counts recorded when they were filled.
 * A direct mode without KV blocks accumulates by a token -> request-slot index instead.
 *
 * Devices. A context lives on one device, fixed at creation:
 *   ELDR_CAPTURE_DEVICE_CPU   every array argument is host memory; every call completes before it
 *                             returns (the `stream` arguments are ignored). This is the reference
 *                             implementation: the CUDA path has identical semantics, bit for bit.
 *   ELDR_CAPTURE_DEVICE_CUDA  array arguments marked "device" are device-accessible memory of the
 *                             context's GPU (device memory, managed memory or pinned host memory);
 *                             work is enqueued on the caller's `stream` (a cudaStream_t passed as
 *                             void*; NULL is the legacy default stream). Record calls never
 *                             synchronise with the host and may be captured into CUDA graphs.
 *   Arrays marked "host" are always host memory and are read before the call returns.
 *
 * Ordering. Operations that touch a context's counts (record, reset, finish, clear) must be ordered
 * with each other: issue them on one stream, or order the streams with events. Results of a finish
 * are ready when its completion handle says so (eldr_capture_result_query / _wait).
 *
 * Bad data never writes out of bounds. Values read from device memory that are out of range are
 * skipped and counted (eldr_capture_stats): expert ids outside [0, E), slots outside the KV cache,
 * block ids outside [0, num_blocks), request indices outside the direct slots. Arguments the host can
 * check (sizes, layer index, host arrays) are rejected with ELDR_CAPTURE_INVALID_ARGUMENT.
 *
 * Errors. Every function that can fail returns an eldr_capture_status. On failure the calling
 * thread's eldr_capture_last_error() says what was wrong.
 *
 * Thread safety. A context may be called from several threads; calls are serialised internally.
 * A result handle may be queried, waited on and released from any thread. A client handle may be
 * used from several threads at once.
 *
 * Memory. A context's buffers are freed when the context and every result it produced are released.
 */
#ifndef ELDR_CAPTURE_H_
#define ELDR_CAPTURE_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define ELDR_CAPTURE_API __attribute__((visibility("default")))
#else
#define ELDR_CAPTURE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Status ------------------------------------------------------------------------------------ */

typedef enum eldr_capture_status {
  ELDR_CAPTURE_OK = 0,
  /* A finish result is not complete yet (eldr_capture_result_query only). */
  ELDR_CAPTURE_NOT_READY = 1,
  /* An argument the host can check is wrong; the message names it. */
  ELDR_CAPTURE_INVALID_ARGUMENT = 2,
  /* Every result slot is held by an unreleased result, or memory could not be allocated. */
  ELDR_CAPTURE_RESOURCE_EXHAUSTED = 3,
  /* No usable device (no GPU, no driver, library built without CUDA), or the router is unreachable. */
  ELDR_CAPTURE_UNAVAILABLE = 4,
  /* The CUDA runtime reported an error; the message carries its name. */
  ELDR_CAPTURE_DEVICE_ERROR = 5,
  /* Router: unknown lease or worker. */
  ELDR_CAPTURE_NOT_FOUND = 6,
  /* Router: the request is valid but the router's state refuses it. */
  ELDR_CAPTURE_FAILED_PRECONDITION = 7,
  /* Router: no answer within the client's timeout. */
  ELDR_CAPTURE_DEADLINE_EXCEEDED = 8,
  /* A caller buffer is too small for a string answer; the message says how many bytes are needed. */
  ELDR_CAPTURE_BUFFER_TOO_SMALL = 9,
  /* Anything else (a bug, or a router status without a closer match). */
  ELDR_CAPTURE_INTERNAL = 10
} eldr_capture_status;

/* Stable name of a status ("OK", "INVALID_ARGUMENT", ...); "UNKNOWN" for other values. */
ELDR_CAPTURE_API const char* eldr_capture_status_name(int status);

/* Message of the last failed call on the calling thread ("" when none; successful calls leave it as
 * it is). Valid until the thread's next failing call into this library. */
ELDR_CAPTURE_API const char* eldr_capture_last_error(void);

/* Library version, "MAJOR.MINOR.PATCH". */
ELDR_CAPTURE_API const char* eldr_capture_version(void);

/* 1 when the library was built with the CUDA kernels and a usable GPU is present, else 0; when 0,
 * eldr_capture_last_error() says why (e.g. "built without CUDA", "cudaGetDeviceCount: ... (35)"). */
ELDR_CAPTURE_API int eldr_capture_cuda_available(void);

/* ---- Types of values --------------------------------------------------------------------------- */

typedef enum eldr_capture_device { ELDR_CAPTURE_DEVICE_CPU = 0, ELDR_CAPTURE_DEVICE_CUDA = 1 } eldr_capture_device;

/* Element type of an index array (expert ids, slots, request indices). */
typedef enum eldr_capture_index_type { ELDR_CAPTURE_INT32 = 0, ELDR_CAPTURE_INT64 = 1 } eldr_capture_index_type;

/* Element type of finished counts. INT16 saturates at 32767 (the router's int16_le wire format);
 * INT32 saturates at 2147483647. FLOAT32 is the type of gate-probability sums: the output of
 * eldr_capture_finish_gate_probs / _finish_direct_gate_probs, and of eldr_capture_client_route's
 * `counts_type` when it sends gate sums. */
typedef enum eldr_capture_output_type {
  ELDR_CAPTURE_OUTPUT_INT16 = 0,
  ELDR_CAPTURE_OUTPUT_INT32 = 1,
  ELDR_CAPTURE_OUTPUT_FLOAT32 = 2
} eldr_capture_output_type;

/* Flags of eldr_capture_record. */
enum {
  /* The caller already called eldr_capture_reset_batch_blocks with this batch's slot mapping on the
   * same stream, before the first record of the batch: record skips its own per-layer reset (one
   * kernel launch instead of two per layer). Without this flag record is self-contained. */
  ELDR_CAPTURE_RECORD_SKIP_RESET = 1u << 0
};

/* ---- Context ----------------------------------------------------------------------------------- */

typedef struct eldr_capture_options {
  /* sizeof(eldr_capture_options); set by eldr_capture_options_init. */
  uint32_t struct_size;
  /* ELDR_CAPTURE_DEVICE_CPU (default) or ELDR_CAPTURE_DEVICE_CUDA. */
  int32_t device;
  /* CUDA device ordinal (default 0). */
  int32_t cuda_device;
  /* MoE layers L and routed experts per layer E (required, > 0). Record's `layer` is in [0, L). */
  int32_t num_layers;
  int32_t num_experts;
  /* Largest top-k any record call passes (default 8; 1..1024). Sizes the per-block counters. */
  int32_t max_top_k;
  /* Physical KV blocks of the engine's cache and tokens per block. num_blocks = 0 disables the block
   * mode (direct mode only). num_blocks * block_size must stay below 2^31. */
  int64_t num_blocks;
  int32_t block_size;
  /* Width of a per-block counter: 0 (default) picks the smallest of 8, 16 and 32 bits whose maximum
   * holds block_size * max_top_k, the most one KV block can add to one (layer, expert) cell, so a
   * counter cannot overflow for any block size; 8, 16 or 32 forces a width (rejected if too narrow). */
  int32_t counter_bits;
  /* Most requests in one finish call (default 64). */
  int32_t max_finish_requests;
  /* Most blocks of one request when a finish call passes its block tables in host memory
   * (default 8192; device block tables have no such limit). */
  int32_t max_blocks_per_request;
  /* Finish results that may be held at once (default 4): a finish call while all are held by
   * unreleased results fails with ELDR_CAPTURE_RESOURCE_EXHAUSTED. */
  int32_t result_slots;
  /* Request slots of the direct mode (default 0: direct mode off). */
  int32_t max_direct_requests;
  /* CUDA: check that device array arguments are device-accessible before launching (default 1). A
   * host pointer passed to a kernel would crash the CUDA context; the check costs ~1 us per call. */
  int32_t validate_pointers;
  /* 1: also keep gate-probability accumulators, per KV block and per direct slot, for
   * eldr_capture_record_gate_probs / _record_direct_gate_probs (default 0). Per block they are L * E
   * 32-bit values (4 bytes per cell, beside the counters). Callers built against an older header
   * (a smaller struct_size) get 0. */
  int32_t record_gate_probs;
} eldr_capture_options;

/* Fills `options` with the defaults above (geometry fields 0: the caller must set them). */
ELDR_CAPTURE_API void eldr_capture_options_init(eldr_capture_options* options);

typedef struct eldr_capture_ctx eldr_capture_ctx;

/* Creates a context and allocates its counters (zeroed). */
ELDR_CAPTURE_API int eldr_capture_create(const eldr_capture_options* options, eldr_capture_ctx** out);

/* Releases the context; pending work is waited for. Results still held stay readable. NULL is a no-op. */
ELDR_CAPTURE_API void eldr_capture_destroy(eldr_capture_ctx* ctx);

typedef struct eldr_capture_info {
  uint32_t struct_size;
  int32_t device;
  int32_t num_layers;
  int32_t num_experts;
  int64_t num_blocks;
  int32_t block_size;
  /* Width of a per-block counter (8, 16 or 32) and its largest value. */
  int32_t counter_bits;
  uint32_t counter_max;
  /* Bytes of per-block counters, and of all buffers of the context on its device. */
  uint64_t block_counts_bytes;
  uint64_t device_bytes;
  /* Bytes of pinned host memory for results (CUDA), or host memory (CPU). */
  uint64_t host_bytes;
  /* Gate probabilities (0 when record_gate_probs is off): fraction bits of the per-block fixed-point
   * accumulators (24, those of the direct mode, without the block mode), and the per-block
   * accumulators' bytes. Written only when struct_size covers them. */
  int32_t gate_prob_fraction_bits;
  uint32_t reserved;
  uint64_t block_gate_prob_bytes;
} eldr_capture_info;

/* Geometry and memory of a context. `info->struct_size` must be set by the caller. */
ELDR_CAPTURE_API int eldr_capture_get_info(const eldr_capture_ctx* ctx, eldr_capture_info* info);

/* ---- Block mode -------------------------------------------------------------------------------- */

/*
 * Adds one MoE layer's routing of one forward batch to the per-block counts.
 *   topk_ids      device, [num_tokens][top_k] of id_type: the experts each token chose.
 *   slot_mapping  device, [num_tokens] of slot_type: each token's KV slot (block * block_size + offset).
 * For every token with a valid slot, block = slot / block_size. First, unless
 * ELDR_CAPTURE_RECORD_SKIP_RESET is set, the row counts[block][layer][:] of every block whose offset-0
 * slot appears in the batch is zeroed (the block is being filled from its start: a reused block never
 * double counts). Then each valid expert id adds 1 to counts[block][layer][id].
 * Negative slots are padding (skipped); slots >= num_blocks * block_size and ids outside [0, E) are
 * skipped and counted. A slot is counted at most once per layer between two resets of its block: a
 * second write of the same slot (an engine bug, or one slot twice in a batch) is dropped and counted
 * as a duplicate, so a counter never exceeds block_size * top_k and cannot overflow.
 * Every MoE layer must be recorded for every batch whose tokens are to be counted.
 */
ELDR_CAPTURE_API int eldr_capture_record(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids, int32_t id_type,
                                         int32_t top_k, const void* slot_mapping, int32_t slot_type, int64_t num_tokens,
                                         uint32_t flags, void* stream);

/* Zeroes, for every layer, every block whose offset-0 slot appears in `slot_mapping` (device,
 * [num_tokens] of slot_type). Call it once per batch before the batch's first record, then pass
 * ELDR_CAPTURE_RECORD_SKIP_RESET to the records of that batch. */
ELDR_CAPTURE_API int eldr_capture_reset_batch_blocks(eldr_capture_ctx* ctx, const void* slot_mapping, int32_t slot_type,
                                                     int64_t num_tokens, void* stream);

/* Zeroes every per-block and direct-mode counter. */
ELDR_CAPTURE_API int eldr_capture_clear(eldr_capture_ctx* ctx, void* stream);

typedef struct eldr_capture_result eldr_capture_result;

/*
 * Sums each finishing request's blocks into its counts [L][E] and copies them to host memory owned by
 * the returned result, asynchronously.
 *   block_tables  [num_requests][block_table_stride] int32 physical block ids, row r = request r's
 *                 block table. Device memory, or host memory (copied; then at most
 *                 max_blocks_per_request blocks per request).
 *   lengths       host, [num_requests] int64: request r's tokens. Exactly its first
 *                 ceil(lengths[r] / block_size) table entries are summed; that must not exceed the
 *                 stride. Block ids outside [0, num_blocks) are skipped and counted.
 * The counts are row-major [num_requests][L][E] of output_type, saturating. 1 <= num_requests <=
 * max_finish_requests. Blocks are read in stream order: record the batches first.
 */
ELDR_CAPTURE_API int eldr_capture_finish(eldr_capture_ctx* ctx, const int32_t* block_tables, int64_t block_table_stride,
                                         const int64_t* lengths, int32_t num_requests, int32_t output_type,
                                         void* stream, eldr_capture_result** out);

/*
 * Gate probabilities (a context created with record_gate_probs = 1; FAILED_PRECONDITION otherwise).
 * Two capture modes fill the same accumulators: "topk" (this function: each token's top-k router
 * weights) and "all" (eldr_capture_record_gate_logits: the softmax over all experts of each token's
 * router logits, the reference's gate_prob_all). Sums are comparable only within one mode.
 *
 * eldr_capture_record_gate_probs does everything eldr_capture_record does (same arguments, same
 * resets, same slot rule), and also adds each counted choice's gate probability
 *   topk_weights  device, [num_tokens][top_k] float32: the router's top-k weights of each token
 * to the block's gate-probability accumulator of (layer, expert). A block's accumulators are reset
 * with its counts (whenever it is refilled from offset 0, by record or eldr_capture_reset_batch_blocks,
 * whether or not that record passes probabilities), and a request's sums are the sum over its block
 * table, like its counts. A probability outside [0, 1] (or NaN) is skipped and counted in
 * bad_gate_probs; the choice's count is still added.
 *
 * Exactness. Accumulators are unsigned fixed point: each probability is rounded once to a multiple
 * of 2^-F (F = info.gate_prob_fraction_bits: 24, or fewer when block_size * max_top_k needs more
 * than 8 integer bits), and integer adds make the sum independent of the order in which tokens and
 * GPU threads add; a finish converts each request's integer sum to float32 once (round to nearest).
 * The CUDA path therefore gives the CPU reference's bits exactly. The error against the exact sum
 * of the probabilities is at most n * 2^-(F+1) for n added probabilities, plus the float32 rounding
 * of the total (float32 additions of the same probabilities would err by about as much).
 */
ELDR_CAPTURE_API int eldr_capture_record_gate_probs(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids,
                                                    int32_t id_type, const float* topk_weights, int32_t top_k,
                                                    const void* slot_mapping, int32_t slot_type, int64_t num_tokens,
                                                    uint32_t flags, void* stream);

/* Element type of router logits (eldr_capture_record_gate_logits). */
typedef enum eldr_capture_logits_type {
  ELDR_CAPTURE_LOGITS_FLOAT32 = 0,
  ELDR_CAPTURE_LOGITS_BFLOAT16 = 1,
  ELDR_CAPTURE_LOGITS_FLOAT16 = 2
} eldr_capture_logits_type;

/*
 * The reference's gate_prob_all capture (record_gate_probs = 1): everything eldr_capture_record does
 * for the counts (same arguments, resets, slot rule and duplicate rule), and for each counted token
 * the softmax of its router logits over ALL E experts, not only its top-k:
 *   router_logits  device, [num_tokens][logits_stride] of logits_type (eldr_capture_logits_type): the
 *                  MoE gate's output; row t's first E values are token t's logits. logits_stride is
 *                  in elements, >= E; 0 means E (contiguous rows).
 * adds softmax(router_logits[t])[e] to the block's gate-probability accumulator of (layer, e) for
 * every e in [0, E). The accumulators and their reset rule are those of
 * eldr_capture_record_gate_probs, so one context records one mode: a request's sums come from
 * whichever of the two wrote its blocks (do not mix them; a router's artifact must be calibrated
 * from sums of the mode it is served with). A token with a non-finite logit (inf or NaN) adds no
 * probabilities and counts one bad_gate_probs; its expert choices are still counted.
 *
 * Headroom: each probability is at most 1, so a cell gains at most 1 per token and at most
 * block_size per block, within the block_size * max_top_k the fraction bits are sized for.
 *
 * Exactness. The softmax is computed in double, stably (the row maximum is subtracted first), with
 * an exp of the library's own (a polynomial of correctly rounded IEEE double operations, no libm and
 * no FMA contraction), and the expert order of the sum fixed; each probability p is then rounded
 * once to the grid 2^-F. The CPU reference and the CUDA kernels perform the same operations, so
 * they produce the same accumulator bits, and the finishes the same float32 sums. Against the exact
 * softmax p, the computed probability is within d = (E + 10) * 2^-53 (exp within 2^-50 relative,
 * the sum over E terms, the division), so each rounded probability is within 2^-(F+1) + d of p:
 * round(p * 2^F) itself except when p * 2^F lies within d * 2^F of a rounding boundary (then one
 * grid step off). A request's sum of n tokens is within n * (2^-(F+1) + d) of the exact sum, plus
 * the float32 rounding of the total.
 */
ELDR_CAPTURE_API int eldr_capture_record_gate_logits(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids,
                                                     int32_t id_type, int32_t top_k, const void* router_logits,
                                                     int32_t logits_type, int64_t logits_stride,
                                                     const void* slot_mapping, int32_t slot_type, int64_t num_tokens,
                                                     uint32_t flags, void* stream);

/* Sums each request's blocks' gate-probability accumulators into float32 [num_requests][L][E], read
 * with eldr_capture_result_gate_prob_sums. Arguments and block rule as eldr_capture_finish. */
ELDR_CAPTURE_API int eldr_capture_finish_gate_probs(eldr_capture_ctx* ctx, const int32_t* block_tables,
                                                    int64_t block_table_stride, const int64_t* lengths,
                                                    int32_t num_requests, void* stream, eldr_capture_result** out);

/* Copies per-block counts of blocks [first_block, first_block + num_blocks) into `out` (host,
 * [num_blocks][L][E] int32) and waits for them: for tests and debugging, not the hot path. */
ELDR_CAPTURE_API int eldr_capture_read_block_counts(eldr_capture_ctx* ctx, int64_t first_block, int64_t num_blocks,
                                                    int32_t* out, void* stream);

/* ---- Direct mode (no KV blocks) ---------------------------------------------------------------- */

/* Adds one layer's routing into per-request counts: token t's ids go to request slot
 * token_request[t] (device, [num_tokens] of request_type). Negative indices are padding; indices
 * >= max_direct_requests and bad ids are skipped and counted. Counters are 32-bit and saturate at
 * 2^31 - 1 (counted in saturated_adds). */
ELDR_CAPTURE_API int eldr_capture_record_direct(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids,
                                                int32_t id_type, int32_t top_k, const void* token_request,
                                                int32_t request_type, int64_t num_tokens, void* stream);

/* Copies the counts of request slots `request_slots` (host, [num_requests] distinct int32 slots) into
 * the result as [num_requests][L][E] and zeroes those slots for their next requests. */
ELDR_CAPTURE_API int eldr_capture_finish_direct(eldr_capture_ctx* ctx, const int32_t* request_slots,
                                                int32_t num_requests, int32_t output_type, void* stream,
                                                eldr_capture_result** out);

/* Direct mode with gate probabilities (record_gate_probs = 1): eldr_capture_record_direct, plus each
 * valid choice's probability topk_weights[t][j] (device, float32) added to the slot's accumulators
 * (64-bit fixed point, 24 fraction bits; the same exactness as the block mode). */
ELDR_CAPTURE_API int eldr_capture_record_direct_gate_probs(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids,
                                                           int32_t id_type, const float* topk_weights, int32_t top_k,
                                                           const void* token_request, int32_t request_type,
                                                           int64_t num_tokens, void* stream);

/* Direct mode of eldr_capture_record_gate_logits: eldr_capture_record_direct, plus softmax over all E
 * experts of each token's router logits (device, [num_tokens][logits_stride] of logits_type) added
 * to its slot's accumulators (64-bit, 24 fraction bits; the same softmax and exactness). */
ELDR_CAPTURE_API int eldr_capture_record_direct_gate_logits(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids,
                                                            int32_t id_type, int32_t top_k, const void* router_logits,
                                                            int32_t logits_type, int64_t logits_stride,
                                                            const void* token_request, int32_t request_type,
                                                            int64_t num_tokens, void* stream);

/* The gate-probability sums of request slots (host, distinct) as float32 [num_requests][L][E], and
 * zeroes those slots' gate accumulators (their counts are left to eldr_capture_finish_direct). */
ELDR_CAPTURE_API int eldr_capture_finish_direct_gate_probs(eldr_capture_ctx* ctx, const int32_t* request_slots,
                                                           int32_t num_requests, void* stream,
                                                           eldr_capture_result** out);

/* Copies direct-mode counts of slots [first_slot, first_slot + num_slots) into `out` (host,
 * [num_slots][L][E] int32) and waits for them. */
ELDR_CAPTURE_API int eldr_capture_read_direct_counts(eldr_capture_ctx* ctx, int32_t first_slot, int32_t num_slots,
                                                     int32_t* out, void* stream);

/* ---- Results ----------------------------------------------------------------------------------- */

/* ELDR_CAPTURE_OK when the result's counts are in host memory, ELDR_CAPTURE_NOT_READY while the copy
 * is pending, or the CUDA error that stopped it. Never blocks. */
ELDR_CAPTURE_API int eldr_capture_result_query(const eldr_capture_result* result);

/* Blocks until the result is ready (or failed). */
ELDR_CAPTURE_API int eldr_capture_result_wait(eldr_capture_result* result);

ELDR_CAPTURE_API int32_t eldr_capture_result_num_requests(const eldr_capture_result* result);
ELDR_CAPTURE_API int32_t eldr_capture_result_output_type(const eldr_capture_result* result);

/* The counts, [num_requests][L][E] of the output type; NULL until the result is ready. Valid until the
 * result is released. */
ELDR_CAPTURE_API const void* eldr_capture_result_counts(const eldr_capture_result* result);

/* The gate-probability sums, [num_requests][L][E] float32, of a result of a gate-probability finish;
 * NULL until ready, and for results of count finishes. Valid until the result is released. */
ELDR_CAPTURE_API const float* eldr_capture_result_gate_prob_sums(const eldr_capture_result* result);

/* Releases the result and its slot. NULL is a no-op. A pending result may be released: its slot is
 * reused once the copy has completed. */
ELDR_CAPTURE_API void eldr_capture_result_release(eldr_capture_result* result);

/* ---- Statistics -------------------------------------------------------------------------------- */

/* Cumulative counters since creation (or eldr_capture_reset_stats). Per call that sees them: a bad
 * slot seen by 48 layer calls counts 48. */
typedef struct eldr_capture_stats {
  uint32_t struct_size;
  uint32_t reserved;
  /* Expert choices added to a counter. */
  uint64_t recorded_choices;
  /* Tokens skipped as padding (negative slot or request index). */
  uint64_t padding_tokens;
  /* Tokens whose slot is >= num_blocks * block_size. */
  uint64_t bad_slots;
  /* Expert choices whose id is outside [0, E) (tokens with a valid slot or request index). */
  uint64_t bad_expert_ids;
  /* Direct mode: tokens whose request index is >= max_direct_requests. */
  uint64_t bad_request_indices;
  /* Finish: block table entries outside [0, num_blocks). */
  uint64_t bad_block_ids;
  /* Tokens dropped because their slot was already counted for that layer since its block's last
   * reset (see eldr_capture_record). */
  uint64_t duplicate_slots;
  /* Direct mode: adds that found their counter at 2^31 - 1 (left there). */
  uint64_t saturated_adds;
  /* Finished counts clipped to the output type's maximum. */
  uint64_t saturated_outputs;
  /* Block rows zeroed because their offset-0 slot was in a batch (per token and call). */
  uint64_t block_resets;
  /* Gate probabilities outside [0, 1] or NaN, skipped, and (eldr_capture_record_gate_logits) tokens
   * whose router logits are not all finite (written only when struct_size covers it). */
  uint64_t bad_gate_probs;
} eldr_capture_stats;

/* Reads the counters, waiting for the work enqueued on `stream`. `stats->struct_size` must be set. */
ELDR_CAPTURE_API int eldr_capture_get_stats(eldr_capture_ctx* ctx, eldr_capture_stats* stats, void* stream);

/* The counters as they were when the result's finish ran (in stream order), ready with the result. */
ELDR_CAPTURE_API int eldr_capture_result_stats(const eldr_capture_result* result, eldr_capture_stats* stats);

/* Sets every counter to zero (in stream order). */
ELDR_CAPTURE_API int eldr_capture_reset_stats(eldr_capture_ctx* ctx, void* stream);

/* ---- Router client ----------------------------------------------------------------------------- */

typedef struct eldr_capture_client_options {
  uint32_t struct_size;
  /* Deadline of each RPC in milliseconds (default 2000). */
  int32_t timeout_ms;
  /* TLS: PEM text of the CA certificates that sign the router's certificate; NULL (default) for a
   * plaintext channel. For mutual TLS also the client's certificate chain and private key (PEM). */
  const char* tls_root_certs_pem;
  const char* tls_client_cert_pem;
  const char* tls_client_key_pem;
  /* Overrides the name checked against the router's certificate (NULL: the target's host). */
  const char* tls_server_name;
} eldr_capture_client_options;

ELDR_CAPTURE_API void eldr_capture_client_options_init(eldr_capture_client_options* options);

typedef struct eldr_capture_client eldr_capture_client;

/* Opens a channel to eldr-router's DecodeRouter service at `target` ("host:port", gRPC syntax).
 * Connecting is lazy: an unreachable router surfaces as ELDR_CAPTURE_UNAVAILABLE on the first call.
 * `options` may be NULL (defaults). */
ELDR_CAPTURE_API int eldr_capture_client_create(const char* target, const eldr_capture_client_options* options,
                                                eldr_capture_client** out);

ELDR_CAPTURE_API void eldr_capture_client_destroy(eldr_capture_client* client);

/* Optional details of a route decision. */
typedef struct eldr_capture_route_details {
  uint32_t struct_size;
  int32_t band_size;
  float similarity;
  uint32_t reserved;
  uint64_t centroid_generation;
  /* NUL-terminated; truncated to the array size. */
  char policy[32];
  char fallback_reason[64];
} eldr_capture_route_details;

/*
 * Calls DecodeRouter.Route for a request whose prefill finished and returns the chosen decode worker.
 *   counts       host, [layers][experts] of counts_type (ELDR_CAPTURE_OUTPUT_INT16: sent as int16_le
 *                bytes; ELDR_CAPTURE_OUTPUT_INT32: sent as packed values; ELDR_CAPTURE_OUTPUT_FLOAT32:
 *                float gate-probability sums, sent as RouteRequest.gate_prob_sums float32_le bytes, for
 *                a router calibrated with the gate_prob variant), e.g. one request's row of
 *                eldr_capture_result_counts or _gate_prob_sums. NULL sends no signature (the router
 *                balances load only).
 *   request_id   NUL-terminated, may be NULL or empty.
 * On success worker_id and address (NUL-terminated) and *lease_id are written, and `details` when not
 * NULL. If worker_id or address does not fit, the route still happened: *lease_id is written (pass it
 * to eldr_capture_client_complete) and ELDR_CAPTURE_BUFFER_TOO_SMALL is returned.
 */
ELDR_CAPTURE_API int eldr_capture_client_route(eldr_capture_client* client, const char* request_id,
                                               int64_t prompt_tokens, const void* counts, int32_t counts_type,
                                               int32_t layers, int32_t experts, char* worker_id,
                                               size_t worker_id_capacity, char* address, size_t address_capacity,
                                               uint64_t* lease_id, eldr_capture_route_details* details);

/* Calls DecodeRouter.Complete: releases the lease once the request's decode finished. */
ELDR_CAPTURE_API int eldr_capture_client_complete(eldr_capture_client* client, uint64_t lease_id,
                                                  int64_t output_tokens);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ELDR_CAPTURE_H_ */
