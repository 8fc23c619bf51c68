"""ctypes binding of libeldr_capture.so, the ELDR capture library (include/eldr/capture/capture.h).

Needs only the Python standard library and numpy, so any Python engine can use it. The library is
found through, in order: the `path` argument, the ELDR_CAPTURE_LIBRARY environment variable, then
the dynamic loader's search path ("libeldr_capture.so").

    ctx = CaptureContext(num_layers=26, num_experts=64, max_top_k=6, num_blocks=1024, block_size=16)
    ctx.record(layer, topk_ids, slot_mapping)          # numpy arrays on the CPU device
    with ctx.finish(block_tables, lengths) as result:  # int16 [R][L][E]
        counts = result.counts()

With record_gate_probs=1 the context also sums each choice's gate probability (the router's top-k
weights): record_gate_probs / finish_gate_probs in the block mode, record_direct_gate_probs /
finish_direct_gate_probs in the direct mode, float32 [R][L][E] sums; RouterClient.route_gate_prob_sums
sends them to a router calibrated with the gate_prob variant. record_gate_logits /
record_direct_gate_logits fill the same sums the reference's gate_prob_all way instead: the softmax
over ALL experts of each token's router logits [tokens][E] (float32, or bfloat16 / float16 by
pointer). A router's artifact must be calibrated from sums of the mode it is served with.

On a CUDA context pass device pointers with record_ptr (e.g. torch's tensor.data_ptr()); numpy
arrays are host memory and are refused there with a clear error. Every failure raises CaptureError
with the library's status name and message.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Optional

import numpy as np

# ---- Constants of include/eldr/capture/capture.h ---------------------------------------------------------

OK = 0
NOT_READY = 1
DEVICE_CPU = 0
DEVICE_CUDA = 1
INT32 = 0
INT64 = 1
OUTPUT_INT16 = 0
OUTPUT_INT32 = 1
OUTPUT_FLOAT32 = 2
RECORD_SKIP_RESET = 1
LOGITS_FLOAT32 = 0
LOGITS_BFLOAT16 = 1
LOGITS_FLOAT16 = 2

_INDEX_TYPES = {np.dtype(np.int32): INT32, np.dtype(np.int64): INT64}
_OUTPUT_TYPES = {"int16": OUTPUT_INT16, "int32": OUTPUT_INT32}
_OUTPUT_DTYPES = {OUTPUT_INT16: np.dtype("<i2"), OUTPUT_INT32: np.dtype("<i4"),
                  OUTPUT_FLOAT32: np.dtype("<f4")}


class CaptureError(RuntimeError):
    """A failed library call: `status` (int), `name` (e.g. "INVALID_ARGUMENT") and the message."""

    def __init__(self, status: int, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.status = status
        self.name = name
        self.message = message


# ---- Structures (field for field as in capture.h) -----------------------------------------------


class Options(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("cuda_device", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("max_top_k", ctypes.c_int32),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int32),
        ("counter_bits", ctypes.c_int32),
        ("max_finish_requests", ctypes.c_int32),
        ("max_blocks_per_request", ctypes.c_int32),
        ("result_slots", ctypes.c_int32),
        ("max_direct_requests", ctypes.c_int32),
        ("validate_pointers", ctypes.c_int32),
        ("record_gate_probs", ctypes.c_int32),
    ]


class Info(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int32),
        ("counter_bits", ctypes.c_int32),
        ("counter_max", ctypes.c_uint32),
        ("block_counts_bytes", ctypes.c_uint64),
        ("device_bytes", ctypes.c_uint64),
        ("host_bytes", ctypes.c_uint64),
        ("gate_prob_fraction_bits", ctypes.c_int32),
        ("reserved", ctypes.c_uint32),
        ("block_gate_prob_bytes", ctypes.c_uint64),
    ]


class Stats(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("recorded_choices", ctypes.c_uint64),
        ("padding_tokens", ctypes.c_uint64),
        ("bad_slots", ctypes.c_uint64),
        ("bad_expert_ids", ctypes.c_uint64),
        ("bad_request_indices", ctypes.c_uint64),
        ("bad_block_ids", ctypes.c_uint64),
        ("duplicate_slots", ctypes.c_uint64),
        ("saturated_adds", ctypes.c_uint64),
        ("saturated_outputs", ctypes.c_uint64),
        ("block_resets", ctypes.c_uint64),
        ("bad_gate_probs", ctypes.c_uint64),
    ]

    def as_dict(self) -> dict:
        return {name: int(getattr(self, name)) for name, _ in self._fields_[2:]}


class ClientOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_int32),
        ("tls_root_certs_pem", ctypes.c_char_p),
        ("tls_client_cert_pem", ctypes.c_char_p),
        ("tls_client_key_pem", ctypes.c_char_p),
        ("tls_server_name", ctypes.c_char_p),
    ]


class RouteDetails(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("band_size", ctypes.c_int32),
        ("similarity", ctypes.c_float),
        ("reserved", ctypes.c_uint32),
        ("centroid_generation", ctypes.c_uint64),
        ("policy", ctypes.c_char * 32),
        ("fallback_reason", ctypes.c_char * 64),
    ]


# ---- The library ---------------------------------------------------------------------------------


class Library:
    """The loaded shared library with every function's signature declared."""

    def __init__(self, path: Optional[str] = None):
        path = path or os.environ.get("ELDR_CAPTURE_LIBRARY") or "libeldr_capture.so"
        self.path = path
        self.lib = ctypes.CDLL(path)
        vp, i32, i64, u32, u64 = (ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64,
                                  ctypes.c_uint32, ctypes.c_uint64)
        p_i32 = ctypes.POINTER(ctypes.c_int32)
        p_i64 = ctypes.POINTER(ctypes.c_int64)
        signatures = {
            "eldr_capture_status_name": (ctypes.c_char_p, [ctypes.c_int]),
            "eldr_capture_last_error": (ctypes.c_char_p, []),
            "eldr_capture_version": (ctypes.c_char_p, []),
            "eldr_capture_cuda_available": (ctypes.c_int, []),
            "eldr_capture_options_init": (None, [ctypes.POINTER(Options)]),
            "eldr_capture_create": (ctypes.c_int, [ctypes.POINTER(Options), ctypes.POINTER(vp)]),
            "eldr_capture_destroy": (None, [vp]),
            "eldr_capture_get_info": (ctypes.c_int, [vp, ctypes.POINTER(Info)]),
            "eldr_capture_record": (ctypes.c_int, [vp, i32, vp, i32, i32, vp, i32, i64, u32, vp]),
            "eldr_capture_reset_batch_blocks": (ctypes.c_int, [vp, vp, i32, i64, vp]),
            "eldr_capture_clear": (ctypes.c_int, [vp, vp]),
            "eldr_capture_finish": (ctypes.c_int, [vp, p_i32, i64, p_i64, i32, i32, vp,
                                                   ctypes.POINTER(vp)]),
            "eldr_capture_read_block_counts": (ctypes.c_int, [vp, i64, i64, p_i32, vp]),
            "eldr_capture_record_direct": (ctypes.c_int, [vp, i32, vp, i32, i32, vp, i32, i64,
                                                          vp]),
            "eldr_capture_finish_direct": (ctypes.c_int, [vp, p_i32, i32, i32, vp,
                                                          ctypes.POINTER(vp)]),
            "eldr_capture_read_direct_counts": (ctypes.c_int, [vp, i32, i32, p_i32, vp]),
            "eldr_capture_result_query": (ctypes.c_int, [vp]),
            "eldr_capture_result_wait": (ctypes.c_int, [vp]),
            "eldr_capture_result_num_requests": (i32, [vp]),
            "eldr_capture_result_output_type": (i32, [vp]),
            "eldr_capture_result_counts": (vp, [vp]),
            "eldr_capture_result_release": (None, [vp]),
            "eldr_capture_get_stats": (ctypes.c_int, [vp, ctypes.POINTER(Stats), vp]),
            "eldr_capture_result_stats": (ctypes.c_int, [vp, ctypes.POINTER(Stats)]),
            "eldr_capture_reset_stats": (ctypes.c_int, [vp, vp]),
            "eldr_capture_client_options_init": (None, [ctypes.POINTER(ClientOptions)]),
            "eldr_capture_client_create": (ctypes.c_int, [ctypes.c_char_p,
                                                          ctypes.POINTER(ClientOptions),
                                                          ctypes.POINTER(vp)]),
            "eldr_capture_client_destroy": (None, [vp]),
            "eldr_capture_client_route": (ctypes.c_int, [vp, ctypes.c_char_p, i64, vp, i32, i32,
                                                         i32, ctypes.c_char_p, ctypes.c_size_t,
                                                         ctypes.c_char_p, ctypes.c_size_t,
                                                         ctypes.POINTER(u64),
                                                         ctypes.POINTER(RouteDetails)]),
            "eldr_capture_client_complete": (ctypes.c_int, [vp, u64, i64]),
            "eldr_capture_record_gate_probs": (ctypes.c_int, [vp, i32, vp, i32, vp, i32, vp, i32,
                                                              i64, u32, vp]),
            "eldr_capture_finish_gate_probs": (ctypes.c_int, [vp, p_i32, i64, p_i64, i32, vp,
                                                              ctypes.POINTER(vp)]),
            "eldr_capture_record_direct_gate_probs": (ctypes.c_int, [vp, i32, vp, i32, vp, i32, vp,
                                                                     i32, i64, vp]),
            "eldr_capture_finish_direct_gate_probs": (ctypes.c_int, [vp, p_i32, i32, vp,
                                                                     ctypes.POINTER(vp)]),
            "eldr_capture_result_gate_prob_sums": (vp, [vp]),
            "eldr_capture_record_gate_logits": (ctypes.c_int, [vp, i32, vp, i32, i32, vp, i32, i64,
                                                               vp, i32, i64, u32, vp]),
            "eldr_capture_record_direct_gate_logits": (ctypes.c_int, [vp, i32, vp, i32, i32, vp,
                                                                      i32, i64, vp, i32, i64, vp]),
        }
        for name, (restype, argtypes) in signatures.items():
            function = getattr(self.lib, name)
            function.restype = restype
            function.argtypes = argtypes
            setattr(self, name[len("eldr_capture_"):], function)

    def check(self, status: int) -> int:
        """Raises CaptureError for a failed status; returns it otherwise (OK or NOT_READY)."""
        if status in (OK, NOT_READY):
            return status
        name = self.status_name(status).decode()
        raise CaptureError(status, name, self.last_error().decode(errors="replace"))

    def version_string(self) -> str:
        return self.version().decode()

    def cuda_status(self) -> tuple[bool, str]:
        """(True, "") when a GPU is usable, else (False, the reason)."""
        if self.cuda_available() == 1:
            return True, ""
        return False, self.last_error().decode(errors="replace")


_default_library: Optional[Library] = None


def load_library(path: Optional[str] = None) -> Library:
    """The process-wide library (loaded once), or a specific one when `path` is given."""
    global _default_library
    if path is not None:
        return Library(path)
    if _default_library is None:
        _default_library = Library()
    return _default_library


def _stream(stream) -> Optional[int]:
    """A cudaStream_t given as an int, None/0 (legacy default stream) or an object with
    `cuda_stream` (torch.cuda.Stream)."""
    if stream is None:
        return None
    value = getattr(stream, "cuda_stream", stream)
    return int(value) or None


def _index_array(values, name: str) -> np.ndarray:
    """A C-contiguous int32/int64 copy-or-view of `values` (other integer types become int32)."""
    array = np.asarray(values)
    if array.dtype not in _INDEX_TYPES:
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, got {array.dtype}")
        array = array.astype(np.int64 if array.dtype.itemsize > 4 else np.int32)
    return np.ascontiguousarray(array)


def _weight_array(values, shape) -> np.ndarray:
    """A C-contiguous float32 copy-or-view of gate probabilities shaped like topk_ids."""
    array = np.ascontiguousarray(values, dtype=np.float32)
    if array.shape != tuple(shape):
        raise ValueError(f"topk_weights must be shaped like topk_ids {tuple(shape)}, got "
                         f"{array.shape}")
    return array


def _logit_array(values, tokens: int, experts: int) -> tuple:
    """(array, logits type) of router logits [tokens][E]: float32, or float16 kept as float16 (numpy
    has no bfloat16: pass bfloat16 by address with the _ptr methods)."""
    array = np.asarray(values)
    if array.dtype != np.float16:
        array = array.astype(np.float32, copy=False)
    array = np.ascontiguousarray(array)
    if array.shape != (tokens, experts):
        raise ValueError(f"router_logits must be [tokens][experts] = {(tokens, experts)}, got "
                         f"{array.shape}")
    return array, LOGITS_FLOAT16 if array.dtype == np.float16 else LOGITS_FLOAT32


def _tables(block_tables, lengths) -> tuple:
    tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    if tables.ndim == 1:
        tables = tables.reshape(1, -1)
    lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    if tables.shape[0] != lens.shape[0]:
        raise ValueError(f"{tables.shape[0]} block tables for {lens.shape[0]} lengths")
    return tables, lens


# ---- Context -------------------------------------------------------------------------------------


class FinishResult:
    """Finished counts of one finish call; holds a result slot until released (or closed)."""

    def __init__(self, library: Library, handle: ctypes.c_void_p, cells: tuple[int, int]):
        self._library = library
        self._handle = handle
        self._cells = cells

    @property
    def num_requests(self) -> int:
        return int(self._library.result_num_requests(self._handle))

    def ready(self) -> bool:
        return self._library.check(self._library.result_query(self._handle)) == OK

    def wait(self) -> "FinishResult":
        self._library.check(self._library.result_wait(self._handle))
        return self

    def gate_prob_sums(self) -> np.ndarray:
        """A copy of the gate-probability sums, [num_requests][L][E] float32 (a result of a
        gate-probability finish; waits for them)."""
        self.wait()
        if int(self._library.result_output_type(self._handle)) != OUTPUT_FLOAT32:
            raise TypeError("this result holds counts, not gate-probability sums")
        return self.counts()

    def counts(self) -> np.ndarray:
        """A copy of the values, [num_requests][L][E]: int16 or int32 counts, or float32 sums for
        a gate-probability finish (waits for them)."""
        self.wait()
        output = int(self._library.result_output_type(self._handle))
        dtype = _OUTPUT_DTYPES[output]
        shape = (self.num_requests,) + self._cells
        pointer = self._library.result_counts(self._handle)
        size = int(np.prod(shape)) * dtype.itemsize
        raw = ctypes.string_at(pointer, size)
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()

    def stats(self) -> dict:
        self.wait()
        stats = Stats()
        stats.struct_size = ctypes.sizeof(Stats)
        self._library.check(self._library.result_stats(self._handle, ctypes.byref(stats)))
        return stats.as_dict()

    def release(self) -> None:
        if self._handle:
            self._library.result_release(self._handle)
            self._handle = None

    def __enter__(self) -> "FinishResult":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


class CaptureContext:
    """One capture context (eldr_capture_create). Keyword arguments are the fields of
    eldr_capture_options; unset ones keep the library's defaults."""

    def __init__(self, num_layers: int, num_experts: int, *, device: str = "cpu",
                 library: Optional[Library] = None, **options):
        self._library = library or load_library()
        opts = Options()
        self._library.options_init(ctypes.byref(opts))
        opts.device = {"cpu": DEVICE_CPU, "cuda": DEVICE_CUDA}[device]
        opts.num_layers = num_layers
        opts.num_experts = num_experts
        for name, value in options.items():
            if name not in dict(Options._fields_) or name == "struct_size":
                raise TypeError(f"unknown capture option {name!r}")
            setattr(opts, name, int(value))
        handle = ctypes.c_void_p()
        self._library.check(self._library.create(ctypes.byref(opts), ctypes.byref(handle)))
        self._handle = handle
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.device = device
        # The options the context was created with (eldr_capture_options field -> value).
        self.options = {name: int(getattr(opts, name)) for name, _ in Options._fields_[1:]}

    # -- block mode --

    def record(self, layer: int, topk_ids, slot_mapping, *, skip_reset: bool = False,
               stream=None) -> None:
        """Records host arrays (CPU device): topk_ids [tokens][k], slot_mapping [tokens]."""
        ids = _index_array(topk_ids, "topk_ids")
        slots = _index_array(slot_mapping, "slot_mapping")
        if ids.ndim != 2 or slots.ndim != 1 or ids.shape[0] != slots.shape[0]:
            raise ValueError(f"topk_ids must be [tokens][k] and slot_mapping [tokens], got "
                             f"{ids.shape} and {slots.shape}")
        self.record_ptr(layer, ids.ctypes.data, _INDEX_TYPES[ids.dtype], ids.shape[1],
                        slots.ctypes.data, _INDEX_TYPES[slots.dtype], slots.shape[0],
                        skip_reset=skip_reset, stream=stream)

    def record_ptr(self, layer: int, topk_ids_ptr: int, id_type: int, top_k: int,
                   slot_mapping_ptr: int, slot_type: int, num_tokens: int, *,
                   skip_reset: bool = False, stream=None) -> None:
        """Records arrays given by address (device pointers on a CUDA context)."""
        flags = RECORD_SKIP_RESET if skip_reset else 0
        self._library.check(self._library.record(
            self._handle, layer, topk_ids_ptr, id_type, top_k, slot_mapping_ptr, slot_type,
            num_tokens, flags, _stream(stream)))

    def record_gate_probs(self, layer: int, topk_ids, topk_weights, slot_mapping, *,
                          skip_reset: bool = False, stream=None) -> None:
        """record() plus the gate probabilities topk_weights [tokens][k] (float32 host array)."""
        ids = _index_array(topk_ids, "topk_ids")
        weights = _weight_array(topk_weights, ids.shape)
        slots = _index_array(slot_mapping, "slot_mapping")
        if ids.ndim != 2 or slots.ndim != 1 or ids.shape[0] != slots.shape[0]:
            raise ValueError(f"topk_ids must be [tokens][k] and slot_mapping [tokens], got "
                             f"{ids.shape} and {slots.shape}")
        self.record_gate_probs_ptr(layer, ids.ctypes.data, _INDEX_TYPES[ids.dtype],
                                   weights.ctypes.data, ids.shape[1], slots.ctypes.data,
                                   _INDEX_TYPES[slots.dtype], slots.shape[0],
                                   skip_reset=skip_reset, stream=stream)

    def record_gate_probs_ptr(self, layer: int, topk_ids_ptr: int, id_type: int,
                              topk_weights_ptr: int, top_k: int, slot_mapping_ptr: int,
                              slot_type: int, num_tokens: int, *, skip_reset: bool = False,
                              stream=None) -> None:
        """record_ptr plus float32 gate probabilities by address (device pointers on CUDA)."""
        flags = RECORD_SKIP_RESET if skip_reset else 0
        self._library.check(self._library.record_gate_probs(
            self._handle, layer, topk_ids_ptr, id_type, topk_weights_ptr, top_k, slot_mapping_ptr,
            slot_type, num_tokens, flags, _stream(stream)))

    def record_gate_logits(self, layer: int, topk_ids, router_logits, slot_mapping, *,
                           skip_reset: bool = False, stream=None) -> None:
        """record() plus softmax over all experts of router_logits [tokens][E] (host, float32 or
        float16): the reference's gate_prob_all."""
        ids = _index_array(topk_ids, "topk_ids")
        slots = _index_array(slot_mapping, "slot_mapping")
        if ids.ndim != 2 or slots.ndim != 1 or ids.shape[0] != slots.shape[0]:
            raise ValueError(f"topk_ids must be [tokens][k] and slot_mapping [tokens], got "
                             f"{ids.shape} and {slots.shape}")
        logits, logits_type = _logit_array(router_logits, ids.shape[0], self.num_experts)
        self.record_gate_logits_ptr(layer, ids.ctypes.data, _INDEX_TYPES[ids.dtype], ids.shape[1],
                                    logits.ctypes.data, logits_type, self.num_experts,
                                    slots.ctypes.data, _INDEX_TYPES[slots.dtype], slots.shape[0],
                                    skip_reset=skip_reset, stream=stream)

    def record_gate_logits_ptr(self, layer: int, topk_ids_ptr: int, id_type: int, top_k: int,
                               logits_ptr: int, logits_type: int, logits_stride: int,
                               slot_mapping_ptr: int, slot_type: int, num_tokens: int, *,
                               skip_reset: bool = False, stream=None) -> None:
        """record_ptr plus router logits by address ([tokens][logits_stride] of logits_type,
        stride in elements, 0 meaning E; device pointers on CUDA)."""
        flags = RECORD_SKIP_RESET if skip_reset else 0
        self._library.check(self._library.record_gate_logits(
            self._handle, layer, topk_ids_ptr, id_type, top_k, logits_ptr, logits_type,
            logits_stride, slot_mapping_ptr, slot_type, num_tokens, flags, _stream(stream)))

    def finish_gate_probs(self, block_tables, lengths, *, stream=None) -> FinishResult:
        """Gate-probability sums [R][L][E] float32 of requests (same arguments as finish)."""
        tables, lens = _tables(block_tables, lengths)
        handle = ctypes.c_void_p()
        self._library.check(self._library.finish_gate_probs(
            self._handle, tables.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), tables.shape[1],
            lens.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), lens.shape[0], _stream(stream),
            ctypes.byref(handle)))
        return FinishResult(self._library, handle, (self.num_layers, self.num_experts))

    def reset_batch_blocks(self, slot_mapping, *, stream=None) -> None:
        slots = _index_array(slot_mapping, "slot_mapping")
        self.reset_batch_blocks_ptr(slots.ctypes.data, _INDEX_TYPES[slots.dtype], slots.size,
                                    stream=stream)

    def reset_batch_blocks_ptr(self, slot_mapping_ptr: int, slot_type: int, num_tokens: int, *,
                               stream=None) -> None:
        self._library.check(self._library.reset_batch_blocks(
            self._handle, slot_mapping_ptr, slot_type, num_tokens, _stream(stream)))

    def finish(self, block_tables, lengths, *, output: str = "int16",
               stream=None) -> FinishResult:
        """Sums each request's blocks: block_tables [R][stride] int32 (host), lengths [R]."""
        tables, lens = _tables(block_tables, lengths)
        handle = ctypes.c_void_p()
        self._library.check(self._library.finish(
            self._handle, tables.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), tables.shape[1],
            lens.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), lens.shape[0],
            _OUTPUT_TYPES[output], _stream(stream), ctypes.byref(handle)))
        return FinishResult(self._library, handle, (self.num_layers, self.num_experts))

    def read_block_counts(self, first_block: int, num_blocks: int, *, stream=None) -> np.ndarray:
        out = np.zeros((num_blocks, self.num_layers, self.num_experts), dtype=np.int32)
        self._library.check(self._library.read_block_counts(
            self._handle, first_block, num_blocks,
            out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), _stream(stream)))
        return out

    # -- direct mode --

    def record_direct(self, layer: int, topk_ids, token_request, *, stream=None) -> None:
        ids = _index_array(topk_ids, "topk_ids")
        requests = _index_array(token_request, "token_request")
        if ids.ndim != 2 or requests.ndim != 1 or ids.shape[0] != requests.shape[0]:
            raise ValueError(f"topk_ids must be [tokens][k] and token_request [tokens], got "
                             f"{ids.shape} and {requests.shape}")
        self._library.check(self._library.record_direct(
            self._handle, layer, ids.ctypes.data, _INDEX_TYPES[ids.dtype], ids.shape[1],
            requests.ctypes.data, _INDEX_TYPES[requests.dtype], requests.shape[0],
            _stream(stream)))

    def record_direct_gate_probs(self, layer: int, topk_ids, topk_weights, token_request, *,
                                 stream=None) -> None:
        """record_direct() plus the gate probabilities topk_weights [tokens][k] (float32)."""
        ids = _index_array(topk_ids, "topk_ids")
        weights = _weight_array(topk_weights, ids.shape)
        requests = _index_array(token_request, "token_request")
        if ids.ndim != 2 or requests.ndim != 1 or ids.shape[0] != requests.shape[0]:
            raise ValueError(f"topk_ids must be [tokens][k] and token_request [tokens], got "
                             f"{ids.shape} and {requests.shape}")
        self.record_direct_gate_probs_ptr(layer, ids.ctypes.data, _INDEX_TYPES[ids.dtype],
                                          weights.ctypes.data, ids.shape[1], requests.ctypes.data,
                                          _INDEX_TYPES[requests.dtype], requests.shape[0],
                                          stream=stream)

    def record_direct_ptr(self, layer: int, topk_ids_ptr: int, id_type: int, top_k: int,
                          token_request_ptr: int, request_type: int, num_tokens: int, *,
                          stream=None) -> None:
        self._library.check(self._library.record_direct(
            self._handle, layer, topk_ids_ptr, id_type, top_k, token_request_ptr, request_type,
            num_tokens, _stream(stream)))

    def record_direct_gate_probs_ptr(self, layer: int, topk_ids_ptr: int, id_type: int,
                                     topk_weights_ptr: int, top_k: int, token_request_ptr: int,
                                     request_type: int, num_tokens: int, *, stream=None) -> None:
        self._library.check(self._library.record_direct_gate_probs(
            self._handle, layer, topk_ids_ptr, id_type, topk_weights_ptr, top_k,
            token_request_ptr, request_type, num_tokens, _stream(stream)))

    def record_direct_gate_logits(self, layer: int, topk_ids, router_logits, token_request, *,
                                  stream=None) -> None:
        """record_direct() plus softmax over all experts of router_logits [tokens][E] (host)."""
        ids = _index_array(topk_ids, "topk_ids")
        requests = _index_array(token_request, "token_request")
        if ids.ndim != 2 or requests.ndim != 1 or ids.shape[0] != requests.shape[0]:
            raise ValueError(f"topk_ids must be [tokens][k] and token_request [tokens], got "
                             f"{ids.shape} and {requests.shape}")
        logits, logits_type = _logit_array(router_logits, ids.shape[0], self.num_experts)
        self.record_direct_gate_logits_ptr(layer, ids.ctypes.data, _INDEX_TYPES[ids.dtype],
                                           ids.shape[1], logits.ctypes.data, logits_type,
                                           self.num_experts, requests.ctypes.data,
                                           _INDEX_TYPES[requests.dtype], requests.shape[0],
                                           stream=stream)

    def record_direct_gate_logits_ptr(self, layer: int, topk_ids_ptr: int, id_type: int,
                                      top_k: int, logits_ptr: int, logits_type: int,
                                      logits_stride: int, token_request_ptr: int,
                                      request_type: int, num_tokens: int, *, stream=None) -> None:
        self._library.check(self._library.record_direct_gate_logits(
            self._handle, layer, topk_ids_ptr, id_type, top_k, logits_ptr, logits_type,
            logits_stride, token_request_ptr, request_type, num_tokens, _stream(stream)))

    def finish_direct_gate_probs(self, request_slots, *, stream=None) -> FinishResult:
        """Gate-probability sums [R][L][E] float32 of direct slots; zeroes their gate sums."""
        slots = np.ascontiguousarray(request_slots, dtype=np.int32).reshape(-1)
        handle = ctypes.c_void_p()
        self._library.check(self._library.finish_direct_gate_probs(
            self._handle, slots.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), slots.shape[0],
            _stream(stream), ctypes.byref(handle)))
        return FinishResult(self._library, handle, (self.num_layers, self.num_experts))

    def finish_direct(self, request_slots, *, output: str = "int16",
                      stream=None) -> FinishResult:
        slots = np.ascontiguousarray(request_slots, dtype=np.int32).reshape(-1)
        handle = ctypes.c_void_p()
        self._library.check(self._library.finish_direct(
            self._handle, slots.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), slots.shape[0],
            _OUTPUT_TYPES[output], _stream(stream), ctypes.byref(handle)))
        return FinishResult(self._library, handle, (self.num_layers, self.num_experts))

    # -- bookkeeping --

    def stats(self, *, stream=None) -> dict:
        stats = Stats()
        stats.struct_size = ctypes.sizeof(Stats)
        self._library.check(self._library.get_stats(self._handle, ctypes.byref(stats),
                                                     _stream(stream)))
        return stats.as_dict()

    def reset_stats(self, *, stream=None) -> None:
        self._library.check(self._library.reset_stats(self._handle, _stream(stream)))

    def clear(self, *, stream=None) -> None:
        self._library.check(self._library.clear(self._handle, _stream(stream)))

    def info(self) -> dict:
        info = Info()
        info.struct_size = ctypes.sizeof(Info)
        self._library.check(self._library.get_info(self._handle, ctypes.byref(info)))
        return {name: int(getattr(info, name)) for name, _ in Info._fields_[1:]}

    def close(self) -> None:
        if getattr(self, "_handle", None):
            self._library.destroy(self._handle)
            self._handle = None

    def __enter__(self) -> "CaptureContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


# ---- Router client -------------------------------------------------------------------------------


@dataclasses.dataclass
class RouteDecision:
    worker_id: str
    address: str
    lease_id: int
    similarity: float
    band_size: int
    policy: str
    fallback_reason: str
    centroid_generation: int


class RouterClient:
    """A channel to eldr-router's DecodeRouter service (eldr_capture_client_*)."""

    _BUFFER = 1024

    def __init__(self, target: str, *, timeout_ms: int = 2000,
                 tls_root_certs_pem: Optional[str] = None,
                 tls_client_cert_pem: Optional[str] = None,
                 tls_client_key_pem: Optional[str] = None,
                 tls_server_name: Optional[str] = None, library: Optional[Library] = None):
        self._library = library or load_library()
        options = ClientOptions()
        self._library.client_options_init(ctypes.byref(options))
        options.timeout_ms = timeout_ms
        # Keep the encoded strings alive while the library copies them.
        self._pem = [s.encode() if s is not None else None
                     for s in (tls_root_certs_pem, tls_client_cert_pem, tls_client_key_pem,
                               tls_server_name)]
        (options.tls_root_certs_pem, options.tls_client_cert_pem, options.tls_client_key_pem,
         options.tls_server_name) = self._pem
        handle = ctypes.c_void_p()
        self._library.check(self._library.client_create(target.encode(), ctypes.byref(options),
                                                        ctypes.byref(handle)))
        self._handle = handle

    def route(self, counts: Optional[np.ndarray], *, request_id: str = "",
              prompt_tokens: int = 0) -> RouteDecision:
        """Routes with counts [L][E] (int16 sent as int16_le, other integers as packed int32), or
        with no signature when counts is None. Float arrays are refused: gate-probability sums go
        through route_gate_prob_sums."""
        pointer, counts_type, layers, experts = None, OUTPUT_INT16, 0, 0
        array = None
        if counts is not None:
            array = np.asarray(counts)
            if array.ndim != 2:
                raise ValueError(f"counts must be [layers][experts], got shape {array.shape}")
            if not np.issubdtype(array.dtype, np.integer):
                raise TypeError(f"counts must be integers, got {array.dtype} (gate-probability "
                                f"sums: route_gate_prob_sums)")
            if array.dtype == np.int16:
                array = np.ascontiguousarray(array, dtype="<i2")
                counts_type = OUTPUT_INT16
            else:
                array = np.ascontiguousarray(array, dtype="<i4")
                counts_type = OUTPUT_INT32
            pointer = array.ctypes.data
            layers, experts = array.shape
        return self._route(pointer, counts_type, layers, experts, request_id, prompt_tokens)

    def route_gate_prob_sums(self, sums, *, request_id: str = "",
                             prompt_tokens: int = 0) -> RouteDecision:
        """Routes with gate-probability sums [L][E] (sent as float32 little-endian), for a router
        calibrated with the gate_prob variant; it rejects NaN and negative sums."""
        array = np.ascontiguousarray(sums, dtype="<f4")
        if array.ndim != 2:
            raise ValueError(f"gate sums must be [layers][experts], got shape {array.shape}")
        return self._route(array.ctypes.data, OUTPUT_FLOAT32, array.shape[0], array.shape[1],
                           request_id, prompt_tokens)

    def _route(self, pointer, counts_type, layers, experts, request_id, prompt_tokens):
        worker = ctypes.create_string_buffer(self._BUFFER)
        address = ctypes.create_string_buffer(self._BUFFER)
        lease = ctypes.c_uint64()
        details = RouteDetails()
        details.struct_size = ctypes.sizeof(RouteDetails)
        self._library.check(self._library.client_route(
            self._handle, request_id.encode(), prompt_tokens, pointer, counts_type, layers, experts,
            worker, self._BUFFER, address, self._BUFFER, ctypes.byref(lease),
            ctypes.byref(details)))
        return RouteDecision(worker_id=worker.value.decode(), address=address.value.decode(),
                             lease_id=int(lease.value), similarity=float(details.similarity),
                             band_size=int(details.band_size),
                             policy=details.policy.decode(),
                             fallback_reason=details.fallback_reason.decode(),
                             centroid_generation=int(details.centroid_generation))

    def complete(self, lease_id: int, output_tokens: int = 0) -> None:
        self._library.check(self._library.client_complete(self._handle, lease_id, output_tokens))

    def close(self) -> None:
        if getattr(self, "_handle", None):
            self._library.client_destroy(self._handle)
            self._handle = None

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()
