"""The calibration capture (integrations/vllm/eldr_calibration.py and the hooks of
eldr_calibration_run.py) without vLLM: the bundled real traces (data/esft-routing) are replayed as
a vLLM engine would run them, several requests per forward pass, prompts in chunks, then one token
per decode step, through stand-ins of vLLM's MoE routers whose select_experts returns
(topk_weights, topk_ids), into libeldr_capture.so's CPU direct mode. The traces carry no gate
probabilities, so the stand-in router gives every choice 1 / top_k (the counts divided by top_k).
Checked: each request's prompt counts and decode counts (its first N decode positions only) equal a
bincount of the trace, its gate sums equal counts / top_k, and the written ELDR capture file is read
by eldr-calibrate, which runs the layer-mask search on the decode counts and fits count_idf and
gate_prob artifacts from it.
"""

import json
import os
import subprocess
import sys
import tempfile
import types
import unittest

import numpy as np

SOURCE = os.environ.get("ELDR_SOURCE_DIR", ".")
sys.path.insert(0, os.path.join(SOURCE, "integrations", "vllm"))

import eldr_calibration  # noqa: E402
import eldr_calibration_run  # noqa: E402
from eldr_capture import CaptureContext  # noqa: E402

DATA = os.path.join(os.environ.get("ELDR_DATA_DIR", os.path.join(SOURCE, "data")), "esft-routing")
DOMAINS = ["intent", "law", "summary", "translation"]
DECODE_TOKENS = 24


def load_sequences(per_domain):
    """[(domain index, topk [tokens][L][k] uint8)] of the first sequences of each domain."""
    out = []
    for d, domain in enumerate(DOMAINS):
        topk = np.load(os.path.join(DATA, f"{domain}_topk.npy"))
        offsets = np.load(os.path.join(DATA, f"{domain}_offsets.npy"))
        for s in range(min(per_domain, len(offsets) - 1)):
            out.append((d, topk[offsets[s]:offsets[s + 1]]))
    return out


def bincount(topk, experts):
    """[L][E] counts of topk [tokens][L][k]."""
    layers = topk.shape[1]
    counts = np.zeros((layers, experts), dtype=np.int64)
    for layer in range(layers):
        counts[layer] = np.bincount(topk[:, layer, :].reshape(-1), minlength=experts)
    return counts


def stub_logits(ids, experts):
    """Router logits [tokens][E] of the stand-in gate: 2 + 0.5 * rank on the chosen experts, a
    per-expert ramp elsewhere (float32)."""
    tokens, k = ids.shape
    logits = np.tile(np.linspace(-1.0, 0.5, experts, dtype=np.float32), (tokens, 1))
    for j in range(k):
        logits[np.arange(tokens), ids[:, j]] = 2.0 + 0.5 * (k - j)
    return logits


def softmax_sums(topk, experts):
    """[L][E] sums over tokens of softmax(stub_logits) over all experts (float64)."""
    out = np.zeros((topk.shape[1], experts))
    for layer in range(topk.shape[1]):
        x = stub_logits(topk[:, layer, :].astype(np.int64), experts).astype(np.float64)
        e = np.exp(x - x.max(axis=1, keepdims=True))
        out[layer] = (e / e.sum(axis=1, keepdims=True)).sum(axis=0)
    return out


class StubRouter:
    """Stands in for vLLM's BaseRouter: select_experts returns (topk_weights, topk_ids) of the
    tokens the engine loop put in the current pass, for this router's layer."""

    def __init__(self, engine, layer, top_k):
        self.engine = engine
        self.layer = layer
        self.top_k = top_k

    def select_experts(self, hidden_states, router_logits):
        assert router_logits is self.engine.pass_logits[self.layer]
        ids = self.engine.pass_ids[:, self.layer, :].astype(np.int64)
        weights = np.full(ids.shape, 1.0 / self.top_k, dtype=np.float32)
        return weights, ids

    def set_capture_fn(self, fn):  # find_moe_modules looks for a capturable router
        raise AssertionError("the calibration run hooks select_experts, not the capture fn")


class StubMoE:
    def __init__(self, engine, layer_id, layer, experts, top_k):
        self.layer_id = layer_id
        self.global_num_experts = experts
        self.router = StubRouter(engine, layer, top_k)


class StubEngine:
    """Runs requests like a continuous-batching engine: up to 3 in flight, each pass takes a chunk
    (at most 40 tokens) of every prefilling request and one token of every decoding one, plus
    padding tokens at the end; then calls every MoE layer in order."""

    def __init__(self, layers, experts, top_k):
        self.pass_ids = None
        self.pass_logits = None
        self.experts = experts
        # MoE layers are model layers 1.. (the first is dense), as in DeepSeek-V2-Lite.
        self.modules = [StubMoE(self, layer + 1, layer, experts, top_k) for layer in range(layers)]
        config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(
            static_forward_context={f"model.layers.{m.layer_id}.mlp": m for m in self.modules}))
        self.llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=config))

    def run(self, requests, recorder, on_pass_batch):
        """requests: [(key, prompt_tokens, topk rows of prompt + generated tokens)]."""
        waiting = list(requests)
        running = []  # [key, prompt, rows, position]
        passes = 0
        while waiting or running:
            while waiting and len(running) < 3:
                key, prompt, rows = waiting.pop(0)
                recorder.begin_request(key, prompt)
                running.append([key, prompt, rows, 0])
            entries, rows_of_pass = [], []
            for item in running:
                key, prompt, rows, position = item
                take = min(40, prompt - position) if position < prompt else 1
                entries.append((key, take))
                rows_of_pass.append(rows[position:position + take])
                item[3] += take
            entries.append((None, 2))  # padding (CUDA-graph style)
            rows_of_pass.append(np.zeros((2,) + rows.shape[1:], dtype=rows.dtype))
            self.pass_ids = np.concatenate(rows_of_pass)
            self.pass_logits = [stub_logits(self.pass_ids[:, layer, :], self.experts)
                                for layer in range(len(self.modules))]
            on_pass_batch(entries)
            for layer, module in enumerate(self.modules):
                module.router.select_experts(None, self.pass_logits[layer])
            passes += 1
            for item in list(running):
                key, prompt, rows, position = item
                if position >= len(rows):  # generated everything it had
                    recorder.finish_request(key)
                    running.remove(item)
        return passes


class CalibrationCaptureTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sequences = load_sequences(per_domain=6)
        cls.layers, cls.top_k = cls.sequences[0][1].shape[1], cls.sequences[0][1].shape[2]
        cls.experts = 64

    def replay(self, tmp, gate_mode="all"):
        engine = StubEngine(self.layers, self.experts, self.top_k)
        capture = CaptureContext(self.layers, self.experts, max_top_k=self.top_k,
                                 max_direct_requests=6, max_finish_requests=2,
                                 record_gate_probs=1)
        recorder = eldr_calibration.CalibrationRecorder(capture, decode_tokens=DECODE_TOKENS,
                                                        gate_mode=gate_mode)
        state = {}
        # The script's hooks on the stand-in modules; the stand-in engine declares each pass's
        # layout (several requests per pass) before the first layer runs.
        layers, experts, top_k = eldr_calibration_run.hook_moe_layers(
            engine.llm, recorder, on_pass=lambda tokens: state.setdefault("tokens", []).append(tokens))
        self.assertEqual((layers, experts, top_k), (self.layers, self.experts, self.top_k))
        requests, expected = [], []
        for number, (domain, topk) in enumerate(self.sequences):
            prompt = len(topk) // 2
            generated = len(topk) - prompt
            key = f"r{number}"
            requests.append((key, prompt, topk))
            expected.append((domain, bincount(topk[:prompt], self.experts),
                             bincount(topk[prompt:prompt + DECODE_TOKENS], self.experts),
                             min(generated, DECODE_TOKENS), softmax_sums(topk[:prompt],
                                                                         self.experts)))
        passes = engine.run(requests, recorder, recorder.set_batch)
        self.assertGreater(passes, 50)
        self.assertEqual(len(state["tokens"]), passes)  # the first MoE layer saw every pass
        for record, (domain, *_) in zip(recorder.records, expected):
            record.label = domain
        by_key = {r.key: r for r in recorder.records}
        return [by_key[f"r{i}"] for i in range(len(requests))], expected, recorder

    def test_records_prompt_decode_and_softmax_gate_sums_of_each_request(self):
        with tempfile.TemporaryDirectory() as tmp:
            records, expected, recorder = self.replay(tmp)  # gate_mode "all", the default
            self.assertEqual(recorder.gate_mode, "all")
            for record, (_, prompt, decode, decoded, softmax) in zip(records, expected):
                np.testing.assert_array_equal(record.prefill_counts, prompt, err_msg=record.key)
                np.testing.assert_array_equal(record.decode_counts, decode, err_msg=record.key)
                tokens = int(prompt[0].sum()) // self.top_k
                # softmax over all experts of the prompt tokens' logits: one grid step per token.
                np.testing.assert_allclose(record.gate_prob_sums, softmax, rtol=2 ** -23,
                                           atol=tokens * 2.0 ** -24, err_msg=record.key)
                self.assertTrue(np.all(record.gate_prob_sums > 0))
                np.testing.assert_allclose(record.gate_prob_sums.sum(axis=1), tokens, rtol=1e-5)
            self.assertEqual(int(recorder.capture.stats()["bad_gate_probs"]), 0)

    def test_records_prompt_decode_and_topk_gate_sums_of_each_request(self):
        with tempfile.TemporaryDirectory() as tmp:
            records, expected, recorder = self.replay(tmp, gate_mode="topk")
            self.assertEqual(len(records), len(self.sequences))
            for record, (domain, prompt, decode, decoded, _) in zip(records, expected):
                np.testing.assert_array_equal(record.prefill_counts, prompt, err_msg=record.key)
                np.testing.assert_array_equal(record.decode_counts, decode, err_msg=record.key)
                self.assertEqual(record.decode_tokens, decoded)
                self.assertEqual(int(record.decode_counts.sum()),
                                 decoded * self.layers * self.top_k)
                np.testing.assert_allclose(record.gate_prob_sums, prompt / self.top_k,
                                           rtol=1e-6, atol=1e-5, err_msg=record.key)
            # Long sequences generate more than N: only the first N decode positions count.
            self.assertTrue(any(len(t) - len(t) // 2 > DECODE_TOKENS for _, t in self.sequences))
            # Every direct slot was freed and zeroed for its next request.
            self.assertEqual(recorder.in_flight, 0)
            self.assertEqual(int(recorder.capture.stats()["bad_gate_probs"]), 0)

    def test_eldr_calibrate_reads_the_file_and_searches_layers_on_its_decode_counts(self):
        calibrate = os.environ.get("ELDR_CALIBRATE")
        if not calibrate:
            self.skipTest("ELDR_CALIBRATE (path of eldr-calibrate) not set")
        with tempfile.TemporaryDirectory() as tmp:
            records, expected, recorder = self.replay(tmp)
            path = os.path.join(tmp, "calibration.cap")
            self.assertEqual(recorder.write(path), len(records))
            with open(path, "rb") as f:
                header = f.read(24)
            self.assertEqual(header[:8], b"ELDRCAPT")
            self.assertEqual(int.from_bytes(header[20:24], "little"), 0b1011)  # decode, label, gate
            artifact, report = os.path.join(tmp, "centroids.json"), os.path.join(tmp, "report.json")
            run = subprocess.run([calibrate, "--captures", path, "--clusters", "4", "--seed", "1",
                                  "--workers", "d0,d1,d2,d3", "--out", artifact,
                                  "--report", report], capture_output=True, text=True,
                                 timeout=300)
            self.assertEqual(run.returncode, 0, run.stderr)
            with open(report) as f:
                figures = json.load(f)
            self.assertEqual(figures["requests"], len(records))
            self.assertEqual(figures["variant"], "count_idf")
            # The mask search ran on the file's decode counts: its steps and correlations.
            self.assertGreater(len(figures["mask"]["steps"]), 0)
            self.assertGreater(figures["mask"]["correlation"], 0.0)
            with open(artifact) as f:
                centroids = json.load(f)
            self.assertEqual(centroids["k"], 4)
            mask = centroids["layer_mask"]
            self.assertEqual(mask, sorted(set(mask)))
            self.assertGreater(len(mask), 0)
            self.assertLessEqual(len(mask), self.layers)
            self.assertEqual(figures["layer_mask"], mask)
            # The kept layers are a prefix of the greedy steps.
            steps = [step["layer"] for step in figures["mask"]["steps"]]
            self.assertEqual(sorted(steps[:len(mask)]), mask)

            # The file's gate sums feed the gate_prob variant.
            gate_artifact = os.path.join(tmp, "gate.json")
            run = subprocess.run([calibrate, "--captures", path, "--clusters", "4", "--seed", "1",
                                  "--variant", "gate_prob", "--out", gate_artifact],
                                 capture_output=True, text=True, timeout=300)
            self.assertEqual(run.returncode, 0, run.stderr)
            with open(gate_artifact) as f:
                self.assertEqual(json.load(f)["variant"], "gate_prob_all")

    def test_capture_file_bytes_match_the_documented_format(self):
        prefill = np.array([[[1, 40000]], [[0, 2]]])  # 40000 forces int32 counts
        decode = np.array([[[3, 0]], [[0, 1]]])
        gate = np.array([[[0.5, 1.25]], [[0.0, 2.0]]], dtype=np.float32)
        data = eldr_calibration.serialize_capture_file(prefill, decode, gate, [7, 0])
        self.assertEqual(data[:8], b"ELDRCAPT")
        version, layers, experts, flags = np.frombuffer(data[8:24], dtype="<u4")
        self.assertEqual((version, layers, experts, flags), (1, 1, 2, 0b1111))
        record = 2 * 4 + 2 * 4 + 2 * 4 + 4
        self.assertEqual(len(data), 24 + 2 * (4 + record))
        first = data[24:24 + 4 + record]
        self.assertEqual(int.from_bytes(first[:4], "little"), record)
        np.testing.assert_array_equal(np.frombuffer(first[4:12], "<i4"), [1, 40000])
        np.testing.assert_array_equal(np.frombuffer(first[12:20], "<i4"), [3, 0])
        np.testing.assert_array_equal(np.frombuffer(first[20:28], "<f4"), [0.5, 1.25])
        self.assertEqual(int.from_bytes(first[28:32], "little"), 7)
        with self.assertRaises(ValueError):
            eldr_calibration.serialize_capture_file(prefill, decode, -gate)
        with self.assertRaises(ValueError):
            eldr_calibration.serialize_capture_file(prefill.astype(np.float32))

    def test_recorder_refuses_a_context_it_cannot_use(self):
        no_gate = CaptureContext(2, 4, max_direct_requests=4)
        with self.assertRaises(ValueError):
            eldr_calibration.CalibrationRecorder(no_gate)
        one_slot = CaptureContext(2, 4, max_direct_requests=1, record_gate_probs=1)
        with self.assertRaises(ValueError):
            eldr_calibration.CalibrationRecorder(one_slot)
        recorder = eldr_calibration.CalibrationRecorder(
            CaptureContext(2, 4, max_direct_requests=2, record_gate_probs=1))
        recorder.begin_request("a", 3)
        with self.assertRaises(RuntimeError):  # both slots held by "a"
            recorder.begin_request("b", 3)
        recorder.set_batch([("a", 1)])
        with self.assertRaises(ValueError):  # gate_mode "all" needs the router logits
            recorder.record(0, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32))
        with self.assertRaises(ValueError):
            eldr_calibration.CalibrationRecorder(
                CaptureContext(2, 4, max_direct_requests=2, record_gate_probs=1), gate_mode="x")


if __name__ == "__main__":
    unittest.main()
