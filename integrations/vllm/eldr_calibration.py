"""Calibration capture: per request, prompt counts, decode counts over its first N generated tokens
and prompt gate-probability sums, written as an ELDR capture file that eldr-calibrate reads
(docs/calibration.md, "The calibration run" and "Capture file format").

The recording uses the capture library's direct mode (token -> request slot), not the KV-block
mode of serving: a calibration run disables the prefix cache, so every prompt token is computed,
and decode tokens are attributed to their request by position instead of by KV block (a decode
token's KV slot says nothing about whether it is among the first N generated tokens). Each
request holds two direct slots: its prompt slot (counts and gate probabilities of every prompt
position) and its decode slot (counts of positions prompt_tokens .. prompt_tokens + N - 1: the
decode forward passes of its first N generated tokens; see CalibrationRecorder).

    recorder = CalibrationRecorder(CaptureContext(L, E, max_top_k=k, max_direct_requests=2 * R,
                                                  record_gate_probs=1), decode_tokens=128)
    recorder.begin_request("r0", prompt_tokens=412, label=3)
    recorder.set_batch([("r0", 412)])                 # the next forward pass: r0's 412 tokens
    for layer in range(L): recorder.record(layer, topk_ids, router_logits=router_logits)
    recorder.set_batch([("r0", 1)])                   # a decode step
    ...
    recorder.finish_request("r0")
    recorder.write("calibration.cap")

Gate sums. gate_mode="all" (the default) records the reference's gate_prob_all: per prompt token
the softmax over ALL experts of the MoE gate's router logits [tokens][E] (record(...,
router_logits=...)); gate_mode="topk" records the router's top-k weights instead (record(layer,
topk_ids, topk_weights)). The capture file does not say which: an artifact calibrated from it must
be served with sums captured in the same mode (eldr_vllm's ELDR_GATE_PROBS=all or topk).

Needs only numpy and eldr_capture (the ctypes binding); eldr_calibration_run.py drives it from vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Optional, Sequence

import numpy as np

from eldr_capture import CaptureContext

DEFAULT_DECODE_TOKENS = 128

# ---- The ELDR capture file, version 1 (src/calib/capture_file.cc) --------------------------------

_MAGIC = b"ELDRCAPT"
_VERSION = 1
_HAS_DECODE = 1 << 0
_HAS_LABEL = 1 << 1
_INT32_COUNTS = 1 << 2
_HAS_GATE_SUMS = 1 << 3


def serialize_capture_file(prefill_counts, decode_counts=None, gate_prob_sums=None,
                           labels=None) -> bytes:
    """The bytes of an ELDR capture file (version 1) of N requests: prefill counts [N][L][E]
    (integers >= 0), optionally decode counts [N][L][E], gate-probability sums [N][L][E] (finite,
    >= 0) and labels [N] (ints >= 0). Counts are int16 when every value fits, int32 otherwise."""
    prefill = np.asarray(prefill_counts)
    if prefill.ndim != 3 or not np.issubdtype(prefill.dtype, np.integer):
        raise ValueError(f"prefill counts must be integers [N][L][E], got {prefill.dtype} "
                         f"{prefill.shape}")
    n, layers, experts = prefill.shape
    parts = [prefill]
    flags = 0
    decode = None
    if decode_counts is not None:
        decode = np.asarray(decode_counts)
        if decode.shape != prefill.shape or not np.issubdtype(decode.dtype, np.integer):
            raise ValueError(f"decode counts must be integers shaped {prefill.shape}")
        flags |= _HAS_DECODE
        parts.append(decode)
    for counts in parts:
        if counts.size and counts.min() < 0:
            raise ValueError("counts must not be negative")
    wide = any(counts.size and counts.max() > 32767 for counts in parts)
    if wide:
        flags |= _INT32_COUNTS
    count_dtype = "<i4" if wide else "<i2"
    gate = None
    if gate_prob_sums is not None:
        gate = np.ascontiguousarray(gate_prob_sums, dtype="<f4")
        if gate.shape != prefill.shape:
            raise ValueError(f"gate sums must be shaped {prefill.shape}, got {gate.shape}")
        if not np.all(np.isfinite(gate)) or (gate.size and gate.min() < 0):
            raise ValueError("gate sums must be finite and >= 0")
        flags |= _HAS_GATE_SUMS
    label_array = None
    if labels is not None:
        label_array = np.asarray(labels, dtype=np.int64).reshape(-1)
        if label_array.shape[0] != n or (n and label_array.min() < 0):
            raise ValueError(f"labels must be {n} ints >= 0")
        flags |= _HAS_LABEL
    cells = layers * experts
    record_bytes = cells * (4 if wide else 2) * (2 if decode is not None else 1)
    record_bytes += cells * 4 if gate is not None else 0
    record_bytes += 4 if label_array is not None else 0
    out = bytearray(_MAGIC + struct.pack("<IIII", _VERSION, layers, experts, flags))
    for r in range(n):
        out += struct.pack("<I", record_bytes)
        out += np.ascontiguousarray(prefill[r], dtype=count_dtype).tobytes()
        if decode is not None:
            out += np.ascontiguousarray(decode[r], dtype=count_dtype).tobytes()
        if gate is not None:
            out += gate[r].tobytes()
        if label_array is not None:
            out += struct.pack("<i", int(label_array[r]))
    return bytes(out)


def write_capture_file(path: str, *args, **kwargs) -> None:
    """serialize_capture_file written to `path` (through a temporary file, renamed)."""
    data = serialize_capture_file(*args, **kwargs)
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


# ---- The recorder -------------------------------------------------------------------------------


GATE_MODES = ("all", "topk")


@dataclasses.dataclass
class CalibrationRecord:
    """One finished request: counts [L][E] int32, gate sums [L][E] float32."""
    key: str
    prompt_tokens: int
    decode_tokens: int  # decode positions counted (<= the recorder's decode_tokens)
    prefill_counts: np.ndarray
    decode_counts: np.ndarray
    gate_prob_sums: np.ndarray
    label: Optional[int] = None


@dataclasses.dataclass
class _Active:
    prompt_slot: int
    decode_slot: int
    prompt_tokens: int
    label: Optional[int]
    position: int = 0  # next position the request's tokens start at


class CalibrationRecorder:
    """Records calibration requests through a direct-mode capture context (CPU device: host
    arrays; record_gate_probs=1; max_direct_requests >= 2 x the requests in flight at once).

    Token attribution. Before each forward pass, set_batch([(key, tokens), ...]) gives the pass's
    tokens in order: each request's next `tokens` positions (unknown keys, e.g. warm-up passes, and
    None give padding). Position p of a request is a prompt token when p < prompt_tokens; it is
    a decode token when prompt_tokens <= p < prompt_tokens + decode_tokens: the forward pass
    whose input is the request's generated token number p - prompt_tokens + 1 (the first generated
    token comes out of the prompt's pass). A request generating G tokens has G - 1 decode passes,
    so decode counts cover the first N generated tokens when it generates N + 1 (the calibration
    run's max_tokens). Later positions are not counted.

    Thread safety: none; one engine loop drives it.
    """

    def __init__(self, capture: CaptureContext, *, decode_tokens: int = DEFAULT_DECODE_TOKENS,
                 gate_mode: str = "all"):
        if gate_mode not in GATE_MODES:
            raise ValueError(f"gate_mode must be one of {GATE_MODES}, got {gate_mode!r}")
        self.gate_mode = gate_mode
        if capture.device != "cpu":
            raise ValueError("the calibration recorder needs a CPU capture context (host arrays)")
        if decode_tokens < 1:
            raise ValueError(f"decode_tokens must be >= 1, got {decode_tokens}")
        self.capture = capture
        self.decode_tokens = decode_tokens
        slots = self._direct_slots()
        self._free = list(range(slots - 1, -1, -1))
        self._active: dict[str, _Active] = {}
        self._token_slots = np.zeros(0, dtype=np.int32)
        self.records: list[CalibrationRecord] = []

    def _direct_slots(self) -> int:
        slots = int(self.capture.options["max_direct_requests"])
        if slots < 2:
            raise ValueError("the capture context needs max_direct_requests >= 2 (two per request)")
        if not self.capture.options["record_gate_probs"]:
            raise ValueError("the capture context needs record_gate_probs=1")
        return slots

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def begin_request(self, key: str, prompt_tokens: int, label: Optional[int] = None) -> None:
        if key in self._active:
            raise ValueError(f"request {key!r} is already being recorded")
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        if len(self._free) < 2:
            raise RuntimeError("no free direct slots: raise max_direct_requests or finish requests")
        self._active[key] = _Active(self._free.pop(), self._free.pop(), prompt_tokens, label)

    def set_batch(self, entries: Sequence[tuple]) -> np.ndarray:
        """Declares the next forward pass's tokens; returns its token -> direct slot array."""
        slots = []
        for key, tokens in entries:
            active = self._active.get(key) if key is not None else None
            if active is None:
                slots.extend([-1] * int(tokens))
                continue
            for p in range(active.position, active.position + int(tokens)):
                if p < active.prompt_tokens:
                    slots.append(active.prompt_slot)
                elif p < active.prompt_tokens + self.decode_tokens:
                    slots.append(active.decode_slot)
                else:
                    slots.append(-1)
            active.position += int(tokens)
        self._token_slots = np.asarray(slots, dtype=np.int32)
        return self._token_slots

    def record(self, layer_index: int, topk_ids, topk_weights=None, *,
               router_logits=None) -> None:
        """One MoE layer of the declared pass: topk_ids [tokens][k] with, by gate_mode, the router
        logits [tokens][E] ("all") or topk_weights [tokens][k] ("topk") (host arrays, or tensors
        with .cpu()); tokens beyond the declared ones are padding."""
        ids = _host(topk_ids)
        if self.gate_mode == "all":
            if router_logits is None:
                raise ValueError("gate_mode 'all' records router_logits [tokens][E]")
            gate = _host(router_logits)
            if gate.dtype != np.float16:
                gate = gate.astype(np.float32, copy=False)
        else:
            if topk_weights is None:
                raise ValueError("gate_mode 'topk' records topk_weights [tokens][k]")
            gate = _host(topk_weights).astype(np.float32, copy=False)
        n = ids.shape[0]
        token_slots = np.full(n, -1, dtype=np.int32)
        m = min(n, self._token_slots.shape[0])
        token_slots[:m] = self._token_slots[:m]
        if n == 0:
            return
        if self.gate_mode == "all":
            self.capture.record_direct_gate_logits(layer_index, ids, gate, token_slots)
        else:
            self.capture.record_direct_gate_probs(layer_index, ids, gate, token_slots)

    def finish_request(self, key: str) -> CalibrationRecord:
        active = self._active.pop(key)
        slots = [active.prompt_slot, active.decode_slot]
        with self.capture.finish_direct(slots, output="int32") as counts:
            values = counts.counts()
        # Both slots' gate sums are read, so the decode slot's (unused) ones are zeroed too.
        with self.capture.finish_direct_gate_probs(slots) as gate:
            sums = gate.gate_prob_sums()
        self._free.extend([active.decode_slot, active.prompt_slot])
        decoded = max(0, min(active.position - active.prompt_tokens, self.decode_tokens))
        record = CalibrationRecord(key=key, prompt_tokens=active.prompt_tokens,
                                   decode_tokens=decoded, prefill_counts=values[0],
                                   decode_counts=values[1], gate_prob_sums=sums[0],
                                   label=active.label)
        self.records.append(record)
        return record

    def write(self, path: str) -> int:
        """Writes every finished request (labels when every record has one); returns N."""
        if not self.records:
            raise ValueError("no finished calibration requests to write")
        labels = None
        if all(r.label is not None for r in self.records):
            labels = [r.label for r in self.records]
        write_capture_file(path, np.stack([r.prefill_counts for r in self.records]),
                           np.stack([r.decode_counts for r in self.records]),
                           np.stack([r.gate_prob_sums for r in self.records]), labels)
        return len(self.records)


def _host(array) -> np.ndarray:
    if hasattr(array, "detach"):  # torch.Tensor: a synchronising copy (calibration is offline)
        array = array.detach()
        if str(array.dtype) == "torch.bfloat16" or str(array.dtype) == "torch.float16":
            array = array.float()
        array = array.cpu().numpy()
    return np.ascontiguousarray(array)
