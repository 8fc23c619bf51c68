"""ELDR expert-count capture for vLLM prefill instances (see README.md in this folder).

What it does, per request, on a prefill instance of a prefill/decode-disaggregated deployment:
  1. registers a callback on every MoE layer's routing capture hook (BaseRouter.set_capture_fn),
     which hands the layer's logical top-k expert ids to libeldr_capture.so together with the
     batch's KV slot mapping (device pointers; no host synchronisation);
  2. when the request finishes, sums the KV blocks of its prompt into counts [L][E] and attaches
     them, int16 little-endian and base64, to the request's kv_transfer_params under
     "eldr_expert_counts", next to what the KV connector returns, so that the proxy that picks the
     decode instance can pass them to eldr-router's Route RPC (route_with_counts below).

Targeted vLLM API (V1 engine, checked against vLLM's source in the 0.2x line; vLLM is not installed
where this module is tested, so everything that touches it is imported lazily):
  - vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter.set_capture_fn(fn):
    fn(topk_ids) is called in select_experts with the logical ids (before EPLB), [tokens, top_k];
  - the MoE modules (FusedMoE, or MoERunner in later versions) found in
    vllm_config.compilation_config.static_forward_context, with .router, .layer_id and
    .global_num_experts;
  - vllm.forward_context.get_forward_context().slot_mapping (dict: attention layer -> slot
    mapping tensor), or attn_metadata[layer].slot_mapping in versions without it;
  - KV connector API V1: register_kv_caches(kv_caches) on the worker side and
    request_finished(request, block_ids) -> (delay_free, kv_transfer_params) on the scheduler side.

Use: --kv-transfer-config '{"kv_connector": "EldrNixlConnector",
"kv_connector_module_path": "eldr_vllm", "kv_role": "kv_producer"}' with this folder on PYTHONPATH
and ELDR_CAPTURE_LIBRARY pointing at libeldr_capture.so. EldrNixlConnector is NixlConnector plus
the capture; connector_with_counts(cls) adds it to any other V1 connector class.

Gate-probability sums (for a router calibrated with the gate_prob variant): with a gate mode the
capture also wraps each MoE router's select_experts (BaseRouter.select_experts(hidden_states,
router_logits, ...) -> (topk_weights, topk_ids, ...)), and request_finished attaches the request's
float32 sums under "eldr_gate_prob_sums" ({"layers", "experts", "encoding": "float32_le", "data":
base64}); route_with_gate_prob_sums sends them to the router. Two modes (ELDR_GATE_PROBS, or the
gate_probs argument):
  all   the reference's gate_prob_all: the softmax over ALL experts of the router_logits argument
        of select_experts (the gate linear's output, [tokens][E]), per token, summed per request;
        what eldr_calibration_run.py records by default and eldr-calibrate's gate_prob variant means;
  topk  the router's top-k weights (the topk_weights select_experts returns) of the chosen experts
        ("1" also means topk, as before).
The router's artifact must have been calibrated from sums of the same mode.

Limitation: the counts live on the GPU of the worker that recorded them, and request_finished runs
in the scheduler. Both are in one process when the engine core runs its worker in process
(tensor parallel size 1, vLLM's UniProcExecutor); with multi-process workers the scheduler side
finds no capture, logs it once, and leaves kv_transfer_params unchanged (the router then balances
load only for those requests).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from eldr_capture import (INT32, INT64, LOGITS_BFLOAT16, LOGITS_FLOAT16, LOGITS_FLOAT32,
                          CaptureContext, RouteDecision, RouterClient, load_library)

logger = logging.getLogger("eldr_vllm")

PAYLOAD_KEY = "eldr_expert_counts"
GATE_PAYLOAD_KEY = "eldr_gate_prob_sums"
_INT16_MAX = 32767

# ---- Payload: counts [L][E] as int16 little-endian, base64 ----------------------------------------


def encode_counts(counts) -> dict:
    """The kv_transfer_params entry for counts [L][E]: values clipped to [0, 32767] (the router's
    int16_le wire format saturates), row-major little-endian int16, base64 (standard alphabet)."""
    array = np.asarray(counts)
    if array.ndim != 2:
        raise ValueError(f"counts must be [layers][experts], got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"counts must be integers, got {array.dtype}")
    wire = np.clip(array.astype(np.int64), 0, _INT16_MAX).astype("<i2")
    return _encode_matrix(wire, "int16_le")


def _encode_matrix(wire: np.ndarray, encoding: str) -> dict:
    """A payload entry: geometry, encoding and the row-major bytes of `wire` in base64."""
    return {
        "layers": int(wire.shape[0]),
        "experts": int(wire.shape[1]),
        "encoding": encoding,
        "data": base64.b64encode(wire.tobytes()).decode("ascii"),
    }


def _decode_matrix(entry: dict, encoding: str, dtype: str, what: str) -> np.ndarray:
    """The [L][E] array of a payload entry of `encoding` (numpy `dtype`); ValueError when the
    entry is inconsistent."""
    if entry.get("encoding") != encoding:
        raise ValueError(f"unsupported encoding {entry.get('encoding')!r}")
    layers, experts = int(entry["layers"]), int(entry["experts"])
    raw = base64.b64decode(entry["data"], validate=True)
    if layers <= 0 or experts <= 0 or len(raw) != np.dtype(dtype).itemsize * layers * experts:
        raise ValueError(f"{len(raw)} bytes for {layers} x {experts} {what}")
    return np.frombuffer(raw, dtype=dtype).reshape(layers, experts).copy()


def decode_counts(entry: dict) -> np.ndarray:
    """Counts [L][E] (int16) from an encode_counts entry; ValueError when it is inconsistent."""
    return _decode_matrix(entry, "int16_le", "<i2", "int16 counts")


def attach_counts(kv_transfer_params: Optional[dict], counts) -> dict:
    """A copy of kv_transfer_params (None: empty) with the counts under PAYLOAD_KEY."""
    params = dict(kv_transfer_params or {})
    params[PAYLOAD_KEY] = encode_counts(counts)
    return params


def encode_gate_prob_sums(sums) -> dict:
    """The kv_transfer_params entry for gate-probability sums [L][E]: float32 little-endian,
    row-major, base64 (standard alphabet). Values are sent as they are (the router rejects NaN and
    negative sums)."""
    array = np.asarray(sums)
    if array.ndim != 2:
        raise ValueError(f"gate sums must be [layers][experts], got shape {array.shape}")
    return _encode_matrix(np.ascontiguousarray(array, dtype="<f4"), "float32_le")


def decode_gate_prob_sums(entry: dict) -> np.ndarray:
    """Gate sums [L][E] (float32) from an encode_gate_prob_sums entry; ValueError when it is
    inconsistent."""
    return _decode_matrix(entry, "float32_le", "<f4", "float32 gate sums")


def attach_gate_prob_sums(kv_transfer_params: Optional[dict], sums) -> dict:
    """A copy of kv_transfer_params (None: empty) with the gate sums under GATE_PAYLOAD_KEY."""
    params = dict(kv_transfer_params or {})
    params[GATE_PAYLOAD_KEY] = encode_gate_prob_sums(sums)
    return params


def gate_prob_sums_from_kv_transfer_params(kv_transfer_params: Optional[dict]) -> Optional[np.ndarray]:
    entry = (kv_transfer_params or {}).get(GATE_PAYLOAD_KEY)
    return None if entry is None else decode_gate_prob_sums(entry)


def route_with_gate_prob_sums(client: RouterClient, kv_transfer_params: Optional[dict], *,
                              request_id: str = "", prompt_tokens: int = 0) -> RouteDecision:
    """Routes with the gate sums the prefill attached (router calibrated with gate_prob); falls back
    to the counts, then to load alone, when they are absent."""
    sums = gate_prob_sums_from_kv_transfer_params(kv_transfer_params)
    if sums is not None:
        return client.route_gate_prob_sums(sums, request_id=request_id,
                                           prompt_tokens=prompt_tokens)
    return route_with_counts(client, kv_transfer_params, request_id=request_id,
                             prompt_tokens=prompt_tokens)


def counts_from_kv_transfer_params(kv_transfer_params: Optional[dict]) -> Optional[np.ndarray]:
    entry = (kv_transfer_params or {}).get(PAYLOAD_KEY)
    return None if entry is None else decode_counts(entry)


def route_with_counts(client: RouterClient, kv_transfer_params: Optional[dict], *,
                      request_id: str = "", prompt_tokens: int = 0) -> RouteDecision:
    """For the proxy between prefill and decode: routes a request with the counts its prefill
    attached (or on load alone when there are none)."""
    return client.route(counts_from_kv_transfer_params(kv_transfer_params),
                        request_id=request_id, prompt_tokens=prompt_tokens)


# ---- Arrays handed to the library -------------------------------------------------------------------


@dataclasses.dataclass
class ArrayView:
    address: int
    index_type: int
    shape: tuple
    itemsize: int
    on_gpu: bool


def weight_view(array) -> ArrayView:
    """Address and layout of a C-contiguous float32 torch tensor or numpy array (index_type is
    unused). Other float dtypes must be converted by the caller (torch: .float())."""
    if hasattr(array, "data_ptr"):
        if str(array.dtype) != "torch.float32":
            raise TypeError(f"expected a float32 tensor, got {array.dtype}")
        if not array.is_contiguous():
            raise ValueError("expected a contiguous tensor")
        return ArrayView(int(array.data_ptr()), -1, tuple(array.shape), 4, bool(array.is_cuda))
    array = np.asarray(array)
    if array.dtype != np.float32 or not array.flags.c_contiguous:
        raise TypeError(f"expected a C-contiguous float32 array, got {array.dtype}")
    return ArrayView(array.ctypes.data, -1, array.shape, 4, False)


GATE_MODES = ("off", "topk", "all")


def parse_gate_mode(value) -> str:
    """A gate mode from the gate_probs argument or ELDR_GATE_PROBS: None, False, "", "0", "off" ->
    "off"; True, "1", "topk" -> "topk" (the router's top-k weights); "all" -> "all" (softmax over
    all experts of the router logits, the reference's gate_prob_all)."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "topk"
    text = str(value).strip().lower()
    if text in ("", "0", "off", "false", "no"):
        return "off"
    if text in ("1", "topk", "true", "yes"):
        return "topk"
    if text == "all":
        return "all"
    raise ValueError(f"gate mode must be off, topk (or 1) or all, got {value!r}")


def router_logits_argument(args: tuple, kwargs: dict):
    """The router_logits argument of a select_experts(hidden_states, router_logits, ...) call."""
    if "router_logits" in kwargs:
        return kwargs["router_logits"]
    if len(args) >= 2:
        return args[1]
    raise ValueError("select_experts was called without router_logits")


_LOGIT_TYPES = {"torch.float32": (LOGITS_FLOAT32, 4), "torch.bfloat16": (LOGITS_BFLOAT16, 2),
                "torch.float16": (LOGITS_FLOAT16, 2)}


@dataclasses.dataclass
class LogitsView:
    address: int
    logits_type: int
    shape: tuple
    row_stride: int  # elements between rows
    itemsize: int
    on_gpu: bool


def logits_view(array) -> LogitsView:
    """Address and layout of router logits [tokens][E]: a torch tensor (float32, bfloat16 or
    float16; rows may be strided, elements contiguous) or a numpy float32/float16 array."""
    if hasattr(array, "data_ptr"):
        dtype = str(array.dtype)
        if dtype not in _LOGIT_TYPES:
            raise TypeError(f"router logits must be float32, bfloat16 or float16, got {dtype}")
        if array.dim() != 2 or (array.shape[1] > 1 and array.stride(1) != 1):
            raise ValueError(f"router logits must be [tokens][E] with contiguous rows, got shape "
                             f"{tuple(array.shape)} strides {tuple(array.stride())}")
        logits_type, itemsize = _LOGIT_TYPES[dtype]
        return LogitsView(int(array.data_ptr()), logits_type, tuple(array.shape),
                          int(array.stride(0)) if array.shape[0] > 1 else int(array.shape[1]),
                          itemsize, bool(array.is_cuda))
    array = np.asarray(array)
    if array.dtype not in (np.float32, np.float16):
        array = array.astype(np.float32)
    array = np.ascontiguousarray(array)
    if array.ndim != 2:
        raise ValueError(f"router logits must be [tokens][E], got shape {array.shape}")
    return LogitsView(array.ctypes.data,
                      LOGITS_FLOAT16 if array.dtype == np.float16 else LOGITS_FLOAT32,
                      array.shape, array.shape[1], array.itemsize, False)


def as_float32(weights):
    """topk_weights as float32 (a copy only when needed): torch tensors with .float().contiguous(),
    numpy arrays with np.ascontiguousarray."""
    if hasattr(weights, "data_ptr"):
        return weights.float().contiguous()
    return np.ascontiguousarray(weights, dtype=np.float32)


def array_view(array) -> ArrayView:
    """Address and layout of a C-contiguous int32/int64 torch tensor or numpy array."""
    if hasattr(array, "data_ptr"):  # torch.Tensor, duck-typed so torch stays optional
        dtype = str(array.dtype)
        if dtype not in ("torch.int32", "torch.int64"):
            raise TypeError(f"expected an int32 or int64 tensor, got {dtype}")
        if not array.is_contiguous():
            raise ValueError("expected a contiguous tensor")
        return ArrayView(int(array.data_ptr()), INT64 if dtype == "torch.int64" else INT32,
                         tuple(array.shape), int(array.element_size()), bool(array.is_cuda))
    array = np.asarray(array)
    if array.dtype not in (np.int32, np.int64) or not array.flags.c_contiguous:
        raise TypeError(f"expected a C-contiguous int32 or int64 array, got {array.dtype}")
    return ArrayView(array.ctypes.data, INT64 if array.dtype == np.int64 else INT32,
                     array.shape, array.itemsize, False)


# ---- The capture ----------------------------------------------------------------------------------

_active_lock = threading.Lock()
_active: Optional["EldrPrefillCapture"] = None


def active_capture() -> Optional["EldrPrefillCapture"]:
    """The capture installed in this process, if any."""
    with _active_lock:
        return _active


def find_moe_modules(modules: Iterable[Any]) -> list:
    """The modules whose routing can be captured (a .router with set_capture_fn, a .layer_id),
    sorted by layer id."""
    found = [m for m in modules
             if hasattr(getattr(m, "router", None), "set_capture_fn") and hasattr(m, "layer_id")]
    return sorted(found, key=lambda m: m.layer_id)


class EldrPrefillCapture:
    """Records every MoE layer's routing into per-KV-block counts and finishes requests.

    `slot_mapping_provider()` returns (slot mapping of the current batch, index of its first token
    in the topk_ids the hook receives); `stream_provider()` the current CUDA stream (None on CPU).

    With `reset_per_batch` (default) the first hooked layer of each forward pass resets the batch's
    new blocks for all layers at once and every layer records without its own reset: one kernel per
    layer instead of two. That needs the MoE layers to run in increasing layer order within a
    forward pass, as in decoder-only transformers; pass False for the order-independent per-layer
    reset.
    """

    def __init__(self, capture: CaptureContext, layer_ids: Sequence[int], block_size: int,
                 slot_mapping_provider: Callable[[], tuple], *,
                 stream_provider: Callable[[], Any] = lambda: None, reset_per_batch: bool = True,
                 gate_probs=False):
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"MoE layer ids repeat: {list(layer_ids)}")
        self.capture = capture
        self.layer_index = {layer_id: i for i, layer_id in enumerate(sorted(layer_ids))}
        self.block_size = block_size
        self._slot_mapping = slot_mapping_provider
        self._stream = stream_provider
        self._lock = threading.Lock()
        # Hook calls that failed (logged once): the forward pass goes on without those counts.
        self.failures = 0
        self.reset_per_batch = reset_per_batch
        self._first_hooked = None  # index of the first layer a forward pass reaches
        # Also gate probabilities (the capture must be created with record_gate_probs=1): the hook
        # is then on select_experts, which takes the router logits and returns the weights with
        # the ids. gate_probs: a gate mode (parse_gate_mode: "topk", "all"; True means topk).
        self.gate_mode = parse_gate_mode(gate_probs)
        self.gate_probs = self.gate_mode != "off"

    # -- worker side --

    def install(self, moe_modules: Iterable[Any]) -> int:
        """Chains the capture on each module's router (a callback already there still runs) and
        makes this the process's active capture. Returns the number of hooked layers."""
        hooked = 0
        for module in moe_modules:
            index = self.layer_index[module.layer_id]
            if self._first_hooked is None or index < self._first_hooked:
                self._first_hooked = index
            router = module.router
            if self.gate_probs:
                router.select_experts = self._select_experts_hook(index, router.select_experts)
            else:
                router.set_capture_fn(self._hook(index, getattr(router, "capture_fn", None)))
            hooked += 1
        global _active
        with _active_lock:
            _active = self
        return hooked

    def _hook(self, index: int, previous: Optional[Callable]) -> Callable:
        def capture_fn(topk_ids):
            try:
                self.record(index, topk_ids)
            except Exception:  # never break the model's forward pass over a signature
                self.failures += 1
                if self.failures == 1:
                    logger.exception("ELDR capture failed on MoE layer %d; counting failures",
                                     index)
            if previous is not None:
                previous(topk_ids)
        return capture_fn

    def _select_experts_hook(self, index: int, select_experts: Callable) -> Callable:
        """Wraps a router's select_experts(hidden_states, router_logits, ...) -> (topk_weights,
        topk_ids, ...) to record the ids with the weights (topk) or the router logits (all)."""
        def wrapped(*args, **kwargs):
            result = select_experts(*args, **kwargs)
            try:
                if self.gate_mode == "all":
                    self.record(index, result[1],
                                router_logits=router_logits_argument(args, kwargs))
                else:
                    self.record(index, result[1], result[0])
            except Exception:  # never break the model's forward pass over a signature
                self.failures += 1
                if self.failures == 1:
                    logger.exception("ELDR capture failed on MoE layer %d; counting failures",
                                     index)
            return result
        return wrapped

    def record(self, layer_index: int, topk_ids, topk_weights=None, *,
               router_logits=None) -> None:
        ids = array_view(topk_ids)
        slots_array, first_token = self._slot_mapping()
        slots = array_view(slots_array)
        if len(ids.shape) != 2 or len(slots.shape) != 1:
            raise ValueError(f"topk_ids must be [tokens, top_k] and the slot mapping [tokens], "
                             f"got {ids.shape} and {slots.shape}")
        on_gpu = self.capture.device == "cuda"
        if ids.on_gpu != on_gpu or slots.on_gpu != on_gpu:
            raise ValueError(f"topk_ids and the slot mapping must be "
                             f"{'CUDA tensors' if on_gpu else 'host arrays'} for a "
                             f"{self.capture.device} capture")
        tokens = min(ids.shape[0] - first_token, slots.shape[0])
        if tokens <= 0:
            return
        top_k = ids.shape[1]
        address = ids.address + first_token * top_k * ids.itemsize
        stream = self._stream()
        if self.reset_per_batch and layer_index == self._first_hooked:
            self.capture.reset_batch_blocks_ptr(slots.address, slots.index_type, tokens,
                                                stream=stream)
        if router_logits is not None:
            logits = logits_view(router_logits)
            if (len(logits.shape) != 2 or logits.shape[0] < first_token + tokens
                    or logits.shape[1] != self.capture.num_experts or logits.on_gpu != on_gpu):
                raise ValueError(f"router_logits must be [tokens][{self.capture.num_experts}] "
                                 f"with a row per topk_ids row on the same device, got "
                                 f"{logits.shape}")
            self.capture.record_gate_logits_ptr(
                layer_index, address, ids.index_type, top_k,
                logits.address + first_token * logits.row_stride * logits.itemsize,
                logits.logits_type, logits.row_stride, slots.address, slots.index_type, tokens,
                skip_reset=self.reset_per_batch, stream=stream)
            return
        if topk_weights is None:
            self.capture.record_ptr(layer_index, address, ids.index_type, top_k, slots.address,
                                    slots.index_type, tokens, skip_reset=self.reset_per_batch,
                                    stream=stream)
            return
        weights_array = as_float32(topk_weights)
        weights = weight_view(weights_array)
        if tuple(weights.shape) != tuple(ids.shape) or weights.on_gpu != on_gpu:
            raise ValueError(f"topk_weights must be shaped like topk_ids {ids.shape} on the same "
                             f"device, got {weights.shape}")
        self.capture.record_gate_probs_ptr(
            layer_index, address, ids.index_type, weights.address + first_token * top_k * 4, top_k,
            slots.address, slots.index_type, tokens, skip_reset=self.reset_per_batch,
            stream=stream)

    # -- scheduler side --

    def finish(self, requests: Sequence[tuple], *, stream=None) -> np.ndarray:
        """Counts [R][L][E] int16 of requests given as (block ids, prompt tokens)."""
        if not requests:
            return np.zeros((0, self.capture.num_layers, self.capture.num_experts), np.int16)
        stride = max(1, max(len(blocks) for blocks, _ in requests))
        tables = np.zeros((len(requests), stride), dtype=np.int32)
        lengths = np.zeros(len(requests), dtype=np.int64)
        for row, (blocks, tokens) in enumerate(requests):
            tables[row, :len(blocks)] = blocks
            lengths[row] = tokens
        with self._lock, self.capture.finish(tables, lengths, output="int16",
                                             stream=stream) as result:
            return result.counts()

    def finish_gate_prob_sums(self, requests: Sequence[tuple], *, stream=None) -> np.ndarray:
        """Gate-probability sums [R][L][E] float32 of requests given as (block ids, tokens)."""
        stride = max(1, max(len(blocks) for blocks, _ in requests))
        tables = np.zeros((len(requests), stride), dtype=np.int32)
        lengths = np.zeros(len(requests), dtype=np.int64)
        for row, (blocks, tokens) in enumerate(requests):
            tables[row, :len(blocks)] = blocks
            lengths[row] = tokens
        with self._lock, self.capture.finish_gate_probs(tables, lengths, stream=stream) as result:
            return result.gate_prob_sums()

    def kv_transfer_params(self, params: Optional[dict], block_ids: Sequence[int],
                           prompt_tokens: int) -> dict:
        params = attach_counts(params, self.finish([(list(block_ids), prompt_tokens)])[0])
        if self.gate_probs:
            sums = self.finish_gate_prob_sums([(list(block_ids), prompt_tokens)])[0]
            params = attach_gate_prob_sums(params, sums)
        return params


def _first_group(block_ids) -> list:
    """block_ids as request_finished passes them: a list of ints, or one list per KV cache group
    (hybrid models); the counts follow the first group's full-attention blocks."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids)


def connector_with_counts(base: type) -> type:
    """A subclass of the V1 KV connector class `base` that installs the capture when the worker
    registers its KV caches and attaches the counts in request_finished."""

    class EldrConnector(base):
        _eldr_warned = False

        def register_kv_caches(self, kv_caches):
            super().register_kv_caches(kv_caches)
            try:
                install_from_vllm_config(getattr(self, "_vllm_config", None))
            except Exception:  # the engine must keep serving even if the capture cannot start
                logger.exception("ELDR capture not installed; routing falls back to load")

        def request_finished(self, request, block_ids):
            delay_free, params = super().request_finished(request, block_ids)
            capture = active_capture()
            if capture is None:
                if not EldrConnector._eldr_warned:
                    EldrConnector._eldr_warned = True
                    logger.warning("no ELDR capture in this process (multi-process workers?): "
                                   "kv_transfer_params carry no expert counts")
                return delay_free, params
            try:
                params = capture.kv_transfer_params(params, _first_group(block_ids),
                                                    int(request.num_prompt_tokens))
            except Exception:
                logger.exception("ELDR counts of request %s not attached",
                                 getattr(request, "request_id", "?"))
            return delay_free, params

    EldrConnector.__name__ = f"Eldr{base.__name__}"
    EldrConnector.__qualname__ = EldrConnector.__name__
    return EldrConnector


def install_from_vllm_config(vllm_config, *, library_path: Optional[str] = None,
                             kv_cache_layer: Optional[str] = None,
                             gate_probs=None) -> EldrPrefillCapture:
    """Creates the CUDA capture for a vLLM worker (after its KV cache exists) and hooks every MoE
    layer. `kv_cache_layer` names the attention layer whose slot mapping keys the blocks (default:
    the first one of the batch). `gate_probs` also records gate-probability sums in a gate mode
    (parse_gate_mode: "all", "topk"; default: the ELDR_GATE_PROBS environment variable, off when
    unset)."""
    gate_mode = parse_gate_mode(os.environ.get("ELDR_GATE_PROBS") if gate_probs is None
                                else gate_probs)
    gate_probs = gate_mode != "off"
    import torch  # noqa: PLC0415 (lazy: only on a vLLM worker)
    from vllm.forward_context import get_forward_context  # noqa: PLC0415

    if vllm_config is None:
        raise RuntimeError("the connector has no vllm_config")
    modules = find_moe_modules(vllm_config.compilation_config.static_forward_context.values())
    if not modules:
        raise RuntimeError("no MoE layer with a capturable router (BaseRouter) in this model")
    experts = {int(m.global_num_experts) for m in modules}
    top_k = {int(m.router.top_k) for m in modules}
    if len(experts) != 1 or len(top_k) != 1:
        raise RuntimeError(f"MoE layers differ in experts {experts} or top-k {top_k}")
    cache = vllm_config.cache_config
    num_blocks, block_size = int(cache.num_gpu_blocks), int(cache.block_size)
    max_model_len = int(vllm_config.model_config.max_model_len)
    parallel = vllm_config.parallel_config
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)

    def slot_mapping():
        context = get_forward_context()
        mapping = getattr(context, "slot_mapping", None)
        if isinstance(mapping, list) or isinstance(context.attn_metadata, list):
            raise RuntimeError("ELDR capture does not support micro-batching (dual batch overlap)")
        if isinstance(mapping, dict) and mapping:
            slots = mapping[kv_cache_layer] if kv_cache_layer else next(iter(mapping.values()))
        else:
            metadata = context.attn_metadata
            chosen = metadata[kv_cache_layer] if kv_cache_layer else next(iter(metadata.values()))
            slots = chosen.slot_mapping
        # With data parallelism the MoE may see every rank's tokens; ours start after the others'.
        first = 0
        dp = getattr(context, "dp_metadata", None)
        if dp is not None:
            across = dp.num_tokens_across_dp_cpu
            first = int(across[:dp_rank].sum())
        return slots, first

    num_experts, k = experts.pop(), top_k.pop()
    # Pointers are checked by EldrPrefillCapture.record (CUDA tensors), so the library's own check,
    # which is not allowed while a CUDA graph is being captured, is off.
    capture = CaptureContext(len(modules), num_experts, device="cuda",
                             library=load_library(library_path),
                             cuda_device=torch.cuda.current_device(), max_top_k=k,
                             num_blocks=num_blocks, block_size=block_size,
                             max_blocks_per_request=-(-max_model_len // block_size),
                             validate_pointers=0, record_gate_probs=int(gate_probs))
    eldr = EldrPrefillCapture(capture, [m.layer_id for m in modules], block_size, slot_mapping,
                              stream_provider=lambda: torch.cuda.current_stream().cuda_stream,
                              gate_probs=gate_mode)
    hooked = eldr.install(modules)
    logger.info("ELDR capture on %d MoE layers, %d experts, top-%d, %d KV blocks of %d tokens, "
                "gate sums %s", hooked, num_experts, k, num_blocks, block_size, gate_mode)
    return eldr


def __getattr__(name: str):
    """Connector classes for vLLM's kv_connector_module_path, built on first use so that importing
    this module never imports vLLM."""
    if name == "EldrNixlConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (  # noqa: PLC0415
            NixlConnector)
        cls = connector_with_counts(NixlConnector)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
