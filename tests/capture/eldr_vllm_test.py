"""The vLLM integration (integrations/vllm/eldr_vllm.py) without vLLM: the int16 little-endian
base64 payload attached to kv_transfer_params, the routing-hook wiring on stand-ins of vLLM's MoE
modules and routers (layer ids mapped to contiguous MoE indices, earlier callbacks chained, data
parallel offsets), the KV connector subclass that attaches the counts, and routing with them
through the fake router. The capture runs on the CPU device with numpy arrays, so everything
except the torch/vLLM glue is exercised.
"""

import base64
import logging
import os
import subprocess
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.environ.get("ELDR_SOURCE_DIR", "."), "integrations", "vllm"))

import eldr_capture  # noqa: E402
import eldr_vllm  # noqa: E402
from eldr_capture import CaptureContext, RouterClient  # noqa: E402


class StubRouter:
    """Stands in for vllm's BaseRouter: set_capture_fn / capture_fn / top_k."""

    def __init__(self, top_k, capture_fn=None):
        self.top_k = top_k
        self.capture_fn = capture_fn

    def set_capture_fn(self, fn):
        self.capture_fn = fn


class StubMoE:
    """Stands in for vllm's FusedMoE / MoERunner: layer_id, router, global_num_experts."""

    def __init__(self, layer_id, experts, top_k, capture_fn=None):
        self.layer_id = layer_id
        self.global_num_experts = experts
        self.router = StubRouter(top_k, capture_fn)


class StubConnector:
    """Stands in for a V1 KV connector (scheduler side returns its own kv_transfer_params)."""

    def __init__(self):
        self.registered = None

    def register_kv_caches(self, kv_caches):
        self.registered = kv_caches

    def request_finished(self, request, block_ids):
        return True, {"remote_host": "10.1.2.3", "remote_block_ids": list(block_ids)}


class StubRequest:
    def __init__(self, request_id, num_prompt_tokens):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens


class PayloadTest(unittest.TestCase):

    def test_int16_little_endian_base64(self):
        counts = np.array([[1, 258, 0], [40000, -3, 7]], dtype=np.int64)
        entry = eldr_vllm.encode_counts(counts)
        self.assertEqual(entry["layers"], 2)
        self.assertEqual(entry["experts"], 3)
        self.assertEqual(entry["encoding"], "int16_le")
        raw = base64.b64decode(entry["data"])
        # Row-major, little-endian, clipped to [0, 32767].
        self.assertEqual(raw, bytes([1, 0, 2, 1, 0, 0, 0xff, 0x7f, 0, 0, 7, 0]))
        np.testing.assert_array_equal(eldr_vllm.decode_counts(entry),
                                      [[1, 258, 0], [32767, 0, 7]])

    def test_rejects_inconsistent_payloads(self):
        with self.assertRaises(ValueError):
            eldr_vllm.encode_counts(np.zeros(4, dtype=np.int32))
        with self.assertRaises(TypeError):
            eldr_vllm.encode_counts(np.zeros((2, 2), dtype=np.float32))
        entry = eldr_vllm.encode_counts(np.ones((2, 2), dtype=np.int16))
        entry["experts"] = 3
        with self.assertRaises(ValueError):
            eldr_vllm.decode_counts(entry)
        with self.assertRaises(ValueError):
            eldr_vllm.decode_counts(dict(entry, encoding="values"))

    def test_attach_keeps_the_connectors_params(self):
        original = {"remote_host": "h", "remote_port": 5600}
        params = eldr_vllm.attach_counts(original, np.array([[2, 0]], dtype=np.int16))
        self.assertEqual(params["remote_host"], "h")
        self.assertEqual(params["remote_port"], 5600)
        self.assertNotIn(eldr_vllm.PAYLOAD_KEY, original)
        np.testing.assert_array_equal(eldr_vllm.counts_from_kv_transfer_params(params), [[2, 0]])
        self.assertIn(eldr_vllm.PAYLOAD_KEY, eldr_vllm.attach_counts(None, [[1]]))
        self.assertIsNone(eldr_vllm.counts_from_kv_transfer_params({"remote_host": "h"}))

    def test_importing_does_not_import_vllm_or_torch(self):
        self.assertNotIn("vllm", sys.modules)
        self.assertNotIn("torch", sys.modules)
        with self.assertRaises(AttributeError):
            getattr(eldr_vllm, "NoSuchConnector")


class GatePayloadTest(unittest.TestCase):

    def test_float32_little_endian_base64(self):
        sums = np.array([[0.5, 0.0], [1.25, 3.0]], dtype=np.float64)
        entry = eldr_vllm.encode_gate_prob_sums(sums)
        self.assertEqual((entry["layers"], entry["experts"], entry["encoding"]),
                         (2, 2, "float32_le"))
        raw = base64.b64decode(entry["data"])
        self.assertEqual(raw[:4], bytes([0, 0, 0, 0x3f]))  # 0.5f, little-endian
        np.testing.assert_array_equal(eldr_vllm.decode_gate_prob_sums(entry), sums)
        params = eldr_vllm.attach_gate_prob_sums({"remote_host": "h"}, sums)
        self.assertEqual(params["remote_host"], "h")
        np.testing.assert_array_equal(eldr_vllm.gate_prob_sums_from_kv_transfer_params(params),
                                      sums)
        self.assertIsNone(eldr_vllm.gate_prob_sums_from_kv_transfer_params({"remote_host": "h"}))

    def test_rejects_inconsistent_payloads(self):
        entry = eldr_vllm.encode_gate_prob_sums(np.ones((2, 2)))
        with self.assertRaises(ValueError):
            eldr_vllm.decode_gate_prob_sums(dict(entry, experts=3))
        with self.assertRaises(ValueError):
            eldr_vllm.decode_gate_prob_sums(dict(entry, encoding="int16_le"))
        with self.assertRaises(ValueError):
            eldr_vllm.encode_gate_prob_sums(np.ones(3))


class GateStubRouter(StubRouter):
    """A BaseRouter stand-in whose select_experts returns (topk_weights, topk_ids)."""

    def __init__(self, top_k):
        super().__init__(top_k)
        self.next = None

    def select_experts(self, hidden_states, router_logits):
        return self.next


class GateHookTest(unittest.TestCase):
    """gate_probs=True: the hook wraps select_experts and records weights next to the ids."""

    def test_connector_attaches_counts_and_gate_sums(self):
        eldr_vllm._active = None
        ctx = CaptureContext(2, 6, max_top_k=2, num_blocks=16, block_size=4, record_gate_probs=1)
        modules = [StubMoE(2, 6, 2), StubMoE(5, 6, 2)]
        for module in modules:
            module.router = GateStubRouter(2)
        slots = np.arange(8, 13, dtype=np.int64)  # blocks 2 and 3
        eldr = eldr_vllm.EldrPrefillCapture(ctx, [2, 5], 4, lambda: (slots, 0), gate_probs=True)
        eldr.install(eldr_vllm.find_moe_modules(modules))
        rng = np.random.default_rng(3)
        expected = np.zeros((2, 6))
        for index, module in enumerate(modules):
            ids = rng.integers(0, 6, size=(5, 2)).astype(np.int64)
            ids[:, 1] = (ids[:, 0] + 1) % 6  # distinct per token
            weights = np.full((5, 2), 0.25, dtype=np.float16)  # converted to float32
            weights[:, 0] = 0.75
            module.router.next = (weights, ids)
            returned = module.router.select_experts(None, None)
            self.assertIs(returned[1], ids)  # the model gets what the router returned
            np.add.at(expected[index], ids[:, 0], 0.75)
            np.add.at(expected[index], ids[:, 1], 0.25)
        self.assertEqual(eldr.failures, 0)
        connector = eldr_vllm.connector_with_counts(StubConnector)()
        _, params = connector.request_finished(StubRequest("g", 5), [2, 3])
        np.testing.assert_array_equal(eldr_vllm.gate_prob_sums_from_kv_transfer_params(params),
                                      expected)
        self.assertEqual(int(eldr_vllm.counts_from_kv_transfer_params(params).sum()), 2 * 5 * 2)
        eldr_vllm._active = None
        ctx.close()


class GateAllHookTest(unittest.TestCase):
    """gate_probs="all" (ELDR_GATE_PROBS=all): the select_experts hook records the softmax over
    all experts of its router_logits argument, the reference's gate_prob_all."""

    def test_modes_parse_and_one_keeps_meaning_topk(self):
        self.assertEqual(eldr_vllm.parse_gate_mode(None), "off")
        self.assertEqual(eldr_vllm.parse_gate_mode("0"), "off")
        self.assertEqual(eldr_vllm.parse_gate_mode("1"), "topk")
        self.assertEqual(eldr_vllm.parse_gate_mode(True), "topk")
        self.assertEqual(eldr_vllm.parse_gate_mode("topk"), "topk")
        self.assertEqual(eldr_vllm.parse_gate_mode("ALL"), "all")
        with self.assertRaises(ValueError):
            eldr_vllm.parse_gate_mode("softmax")

    def test_connector_attaches_the_softmax_sums_over_all_experts(self):
        eldr_vllm._active = None
        ctx = CaptureContext(2, 6, max_top_k=2, num_blocks=16, block_size=4, record_gate_probs=1)
        modules = [StubMoE(2, 6, 2), StubMoE(5, 6, 2)]
        for module in modules:
            module.router = GateStubRouter(2)
        slots = np.arange(8, 13, dtype=np.int64)  # blocks 2 and 3
        eldr = eldr_vllm.EldrPrefillCapture(ctx, [2, 5], 4, lambda: (slots, 0), gate_probs="all")
        self.assertEqual(eldr.gate_mode, "all")
        eldr.install(eldr_vllm.find_moe_modules(modules))
        rng = np.random.default_rng(5)
        expected = np.zeros((2, 6))
        for index, module in enumerate(modules):
            ids = np.stack([np.arange(5) % 6, (np.arange(5) + 1) % 6], axis=1).astype(np.int64)
            logits = rng.normal(0, 2, size=(5, 6)).astype(np.float32)
            # Weights that say nothing about the softmax: the all mode must not use them.
            module.router.next = (np.full((5, 2), 0.5, np.float32), ids)
            if index == 0:
                returned = module.router.select_experts(None, logits)
            else:
                returned = module.router.select_experts(hidden_states=None, router_logits=logits)
            self.assertIs(returned[1], ids)
            e = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
            expected[index] = (e / e.sum(axis=1, keepdims=True)).sum(axis=0)
        self.assertEqual(eldr.failures, 0)
        connector = eldr_vllm.connector_with_counts(StubConnector)()
        _, params = connector.request_finished(StubRequest("a", 5), [2, 3])
        sums = eldr_vllm.gate_prob_sums_from_kv_transfer_params(params)
        np.testing.assert_allclose(sums, expected, rtol=1e-6, atol=5 * 2.0 ** -24)
        self.assertTrue(np.all(sums > 0))  # every expert, not only the chosen ones
        np.testing.assert_allclose(sums.sum(axis=1), [5, 5], rtol=1e-6)
        self.assertEqual(int(eldr_vllm.counts_from_kv_transfer_params(params).sum()), 2 * 5 * 2)
        eldr_vllm._active = None
        ctx.close()

    def test_logits_of_the_wrong_width_are_a_counted_failure(self):
        eldr_vllm._active = None
        ctx = CaptureContext(1, 6, max_top_k=2, num_blocks=4, block_size=4, record_gate_probs=1)
        module = StubMoE(0, 6, 2)
        module.router = GateStubRouter(2)
        eldr = eldr_vllm.EldrPrefillCapture(ctx, [0], 4,
                                            lambda: (np.arange(2, dtype=np.int64), 0),
                                            gate_probs="all")
        eldr.install([module])
        module.router.next = (np.ones((2, 2), np.float32), np.zeros((2, 2), np.int64))
        module.router.select_experts(None, np.zeros((2, 5), np.float32))
        self.assertEqual(eldr.failures, 1)
        eldr_vllm._active = None
        ctx.close()


class HookTest(unittest.TestCase):
    LAYERS = (1, 3, 7)  # decoder layers with MoE (the others are dense)
    EXPERTS = 8
    TOP_K = 2
    BLOCK = 4

    RESET_PER_BATCH = True

    def setUp(self):
        eldr_vllm._active = None
        self.ctx = CaptureContext(len(self.LAYERS), self.EXPERTS, max_top_k=self.TOP_K,
                                  num_blocks=32, block_size=self.BLOCK)
        self.previous_calls = []
        self.modules = [StubMoE(7, self.EXPERTS, self.TOP_K),
                        StubMoE(1, self.EXPERTS, self.TOP_K,
                                capture_fn=lambda ids: self.previous_calls.append(ids.shape)),
                        StubMoE(3, self.EXPERTS, self.TOP_K)]
        self.batch = {"slots": None, "first": 0}
        self.eldr = eldr_vllm.EldrPrefillCapture(
            self.ctx, [m.layer_id for m in self.modules], self.BLOCK,
            lambda: (self.batch["slots"], self.batch["first"]),
            reset_per_batch=self.RESET_PER_BATCH)
        self.assertEqual(self.eldr.install(eldr_vllm.find_moe_modules(self.modules)), 3)

    def tearDown(self):
        eldr_vllm._active = None
        self.ctx.close()

    def forward(self, routing, slots, *, foreign_rows=0):
        """One forward pass: each MoE layer's router hands its ids to the capture hook."""
        self.batch["slots"] = np.asarray(slots, dtype=np.int64)
        self.batch["first"] = foreign_rows
        # A forward pass reaches the MoE layers in layer order.
        for module in sorted(self.modules, key=lambda m: m.layer_id):
            index = sorted(self.LAYERS).index(module.layer_id)
            ids = routing[:, index, :]
            if foreign_rows:
                # Another data-parallel rank's tokens come first in what the MoE sees.
                other = np.full((foreign_rows, self.TOP_K), 5, dtype=ids.dtype)
                ids = np.concatenate([other, ids])
            module.router.capture_fn(np.ascontiguousarray(ids))

    def expected(self, routing):
        out = np.zeros((len(self.LAYERS), self.EXPERTS), dtype=np.int64)
        for layer in range(len(self.LAYERS)):
            out[layer] = np.bincount(routing[:, layer, :].reshape(-1), minlength=self.EXPERTS)
        return out

    def test_layer_ids_map_to_contiguous_indices(self):
        self.assertEqual(self.eldr.layer_index, {1: 0, 3: 1, 7: 2})

    def test_records_every_layer_and_chains_the_previous_callback(self):
        rng = np.random.default_rng(4)
        routing = rng.integers(0, self.EXPERTS, size=(10, 3, self.TOP_K), dtype=np.int32)
        self.forward(routing[:6], np.arange(8, 14))        # blocks 2 and 3 (partial)
        self.forward(routing[6:], np.arange(14, 18), foreign_rows=3)
        self.assertEqual(self.previous_calls, [(6, 2), (7, 2)])
        counts = self.eldr.finish([([2, 3, 4], 10)])[0]
        np.testing.assert_array_equal(counts, self.expected(routing))
        self.assertEqual(self.eldr.failures, 0)
        self.assertEqual(self.ctx.stats()["recorded_choices"], 10 * 3 * self.TOP_K)

    def test_reused_blocks_are_reset_once_per_forward_pass(self):
        rng = np.random.default_rng(6)
        stale = rng.integers(0, self.EXPERTS, size=(8, 3, self.TOP_K), dtype=np.int32)
        self.forward(stale, np.arange(0, 8))              # blocks 0 and 1, then freed
        fresh = rng.integers(0, self.EXPERTS, size=(6, 3, self.TOP_K), dtype=np.int32)
        self.forward(fresh, np.arange(4, 10))              # block 1 reused, block 2 new
        counts = self.eldr.finish([([1, 2], 6)])[0]
        np.testing.assert_array_equal(counts, self.expected(fresh))
        stats = self.ctx.stats()
        self.assertEqual(stats["duplicate_slots"], 0)
        # Per batch: one all-layer reset per new block, or one per layer call without it.
        resets_per_block = 1 if self.RESET_PER_BATCH else len(self.LAYERS)
        self.assertEqual(stats["block_resets"], 4 * resets_per_block)

    def test_a_failing_hook_never_breaks_the_forward_pass(self):
        self.batch["slots"] = np.arange(3, dtype=np.float64)  # not an index array
        self.batch["first"] = 0
        logging.disable(logging.CRITICAL)
        try:
            for module in self.modules:
                module.router.capture_fn(np.zeros((3, self.TOP_K), dtype=np.int32))
        finally:
            logging.disable(logging.NOTSET)
        self.assertEqual(self.eldr.failures, 3)
        self.assertEqual(self.previous_calls, [(3, 2)])  # the earlier callback still ran

    def test_connector_attaches_the_counts(self):
        routing = np.random.default_rng(8).integers(0, self.EXPERTS, size=(9, 3, self.TOP_K),
                                                    dtype=np.int64)
        self.forward(routing, np.concatenate([np.arange(20, 24), np.arange(4, 9)]))
        connector_class = eldr_vllm.connector_with_counts(StubConnector)
        self.assertEqual(connector_class.__name__, "EldrStubConnector")
        connector = connector_class()
        delay, params = connector.request_finished(StubRequest("r1", 9), [5, 1, 2])
        self.assertTrue(delay)
        self.assertEqual(params["remote_host"], "10.1.2.3")
        np.testing.assert_array_equal(eldr_vllm.counts_from_kv_transfer_params(params),
                                      self.expected(routing))
        # Hybrid models pass one block list per KV cache group; the first one is used.
        _, grouped = connector.request_finished(StubRequest("r1", 9), ([5, 1, 2], [0]))
        self.assertEqual(grouped[eldr_vllm.PAYLOAD_KEY], params[eldr_vllm.PAYLOAD_KEY])

    def test_connector_without_a_capture_passes_params_through(self):
        eldr_vllm._active = None
        connector = eldr_vllm.connector_with_counts(StubConnector)()
        logging.disable(logging.CRITICAL)
        try:
            delay, params = connector.request_finished(StubRequest("r2", 4), [1])
        finally:
            logging.disable(logging.NOTSET)
        self.assertEqual(params, {"remote_host": "10.1.2.3", "remote_block_ids": [1]})


class PerLayerResetHookTest(HookTest):
    RESET_PER_BATCH = False


class RouteWithCountsTest(unittest.TestCase):

    def test_proxy_routes_with_the_attached_counts(self):
        binary = os.environ.get("ELDR_CAPTURE_FAKE_ROUTER")
        if not binary:
            self.fail("ELDR_CAPTURE_FAKE_ROUTER is not set")
        router = subprocess.Popen([binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        try:
            port = router.stdout.readline().split()[1]
            counts = np.zeros((2, 4), dtype=np.int16)
            counts[1, 3] = 9  # flattened argmax 7 -> decode-1
            params = eldr_vllm.attach_counts({"remote_host": "h"}, counts)
            with RouterClient(f"127.0.0.1:{port}") as client:
                decision = eldr_vllm.route_with_counts(client, params, request_id="p",
                                                       prompt_tokens=3)
                self.assertEqual(decision.worker_id, "decode-1")
                self.assertEqual(decision.policy, "eldr")
                fallback = eldr_vllm.route_with_counts(client, {"remote_host": "h"})
                self.assertEqual(fallback.fallback_reason, "no_signature")
                # Gate sums win over counts when both are attached.
                sums = np.zeros((2, 4), dtype=np.float32)
                sums[0, 2] = 1.5  # flattened argmax 2 -> decode-2
                both = eldr_vllm.attach_gate_prob_sums(params, sums)
                gate = eldr_vllm.route_with_gate_prob_sums(client, both, request_id="g")
                self.assertEqual(gate.worker_id, "decode-2")
                counts_only = eldr_vllm.route_with_gate_prob_sums(client, params)
                self.assertEqual(counts_only.worker_id, "decode-1")
                with self.assertRaises(TypeError):
                    client.route(sums)  # floats are not counts
        finally:
            router.stdin.close()
            router.stdout.close()
            try:
                router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()


if __name__ == "__main__":
    unittest.main()
