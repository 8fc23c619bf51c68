"""The C ABI of libeldr_capture.so from Debian's python3 through ctypes (CPU device), with numpy
arrays, against numpy's bincount: a small paged engine (several requests per batch, chunked
prefill, shared prefixes through reused blocks, partial blocks, eviction and reuse, padding, bad
ids, int32 and int64), the bundled real traces, the direct mode, errors, and the router client
against the fake router process.

Run by CTest with ELDR_CAPTURE_LIBRARY (the built library), ELDR_CAPTURE_FAKE_ROUTER (the fake
router binary), ELDR_DATA_DIR and ELDR_SOURCE_DIR set.
"""

import os
import random
import subprocess
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.environ.get("ELDR_SOURCE_DIR", "."), "integrations", "vllm"))

import eldr_capture  # noqa: E402
from eldr_capture import CaptureContext, CaptureError, RouterClient  # noqa: E402


def bincount(routing: np.ndarray, experts: int) -> np.ndarray:
    """Expected counts [L][E] of a prompt's routing [tokens][L][k]: in-range ids only."""
    layers = routing.shape[1]
    out = np.zeros((layers, experts), dtype=np.int64)
    for layer in range(layers):
        ids = routing[:, layer, :].reshape(-1)
        ids = ids[(ids >= 0) & (ids < experts)]
        out[layer] = np.bincount(ids, minlength=experts)
    return out


class PagedEngine:
    """Drives a CPU capture context like a paged-KV prefill engine and checks every finish."""

    def __init__(self, test, ctx, *, layers, experts, top_k, block_size, num_blocks, id_dtype,
                 slot_dtype, seed):
        self.test, self.ctx = test, ctx
        self.layers, self.experts, self.top_k = layers, experts, top_k
        self.block_size, self.num_blocks = block_size, num_blocks
        self.id_dtype, self.slot_dtype = id_dtype, slot_dtype
        self.rng = random.Random(seed)
        self.free = list(range(num_blocks - 1, -1, -1))  # LIFO: freed blocks are reused first
        self.ever_freed = set()
        self.reused = 0
        self.shared_blocks = 0
        self.finished = 0
        self.expected_bad_ids = 0
        self.expected_padding = 0

    def allocate(self):
        block = self.free.pop()
        if block in self.ever_freed:
            self.reused += 1
        return block

    def release(self, blocks):
        for block in blocks:
            self.ever_freed.add(block)
            self.free.append(block)

    def run(self, prompts):
        """prompts: list of (routing [T][L][k], shared_from index or None, shared blocks)."""
        states = []
        pending = list(range(len(prompts)))
        active = []
        holders = {}  # block -> number of requests holding it
        done = set()
        while pending or active:
            while pending and len(active) < 3:
                index = pending[0]
                routing, source, shared = prompts[index]
                if source is not None and source not in done:
                    break
                pending.pop(0)
                blocks = []
                position = 0
                if source is not None:
                    blocks = list(states[source]["blocks"][:shared])
                    position = shared * self.block_size
                    self.shared_blocks += shared
                for b in blocks:
                    holders[b] += 1
                state = {"index": index, "blocks": blocks, "position": position}
                while len(states) <= index:
                    states.append(None)
                states[index] = state
                active.append(index)
            tokens = []  # (index or None, position, slot, ids [L][k])
            budget = 48
            for index in active:
                state = states[index]
                routing = prompts[index][0]
                remaining = routing.shape[0] - state["position"]
                if budget <= 0 or remaining <= 0:
                    continue
                chunk = min(remaining, self.rng.randint(1, budget))
                for p in range(state["position"], state["position"] + chunk):
                    if p % self.block_size == 0:
                        block = self.allocate()
                        holders[block] = 1
                        state["blocks"].append(block)
                    slot = state["blocks"][p // self.block_size] * self.block_size + \
                        p % self.block_size
                    tokens.append((index, p, slot, routing[p]))
                state["position"] += chunk
                budget -= chunk
            for _ in range(2):  # padding tokens, never counted
                tokens.append((None, 0, -1, np.zeros((self.layers, self.top_k), np.int64)))
                self.expected_padding += self.layers
            self.rng.shuffle(tokens)
            slots = np.array([t[2] for t in tokens], dtype=self.slot_dtype)
            for layer in range(self.layers):
                ids = np.stack([t[3][layer] for t in tokens]).astype(self.id_dtype)
                self.ctx.record(layer, ids, slots)
            for t in tokens:
                if t[0] is not None:
                    ids = t[3]
                    self.expected_bad_ids += int(np.sum((ids < 0) | (ids >= self.experts)))
            finishing = [i for i in active if states[i]["position"] == prompts[i][0].shape[0]]
            if finishing:
                stride = max(len(states[i]["blocks"]) for i in finishing) + 1
                tables = np.full((len(finishing), stride), self.num_blocks + 3, dtype=np.int32)
                lengths = np.zeros(len(finishing), dtype=np.int64)
                for row, i in enumerate(finishing):
                    tables[row, :len(states[i]["blocks"])] = states[i]["blocks"]
                    lengths[row] = prompts[i][0].shape[0]
                with self.ctx.finish(tables, lengths, output="int32") as result:
                    counts = result.counts()
                for row, i in enumerate(finishing):
                    expected = bincount(prompts[i][0], self.experts)
                    np.testing.assert_array_equal(counts[row], expected,
                                                  err_msg=f"request {i}")
                    self.finished += 1
                    done.add(i)
                    active.remove(i)
            # Evict finished requests once no waiting request still needs their prefix; blocks
            # a sharer holds stay until the sharer is evicted too.
            for i in list(done):
                state = states[i]
                if state["blocks"] and not any(prompts[j][1] == i for j in pending):
                    self._drop(state, holders)

    def _drop(self, state, holders):
        freed = []
        for b in state["blocks"]:
            holders[b] -= 1
            if holders[b] == 0:
                freed.append(b)
        state["blocks"] = []
        self.release(freed)


def random_prompts(rng, count, layers, experts, top_k, block_size, bad_rate, id64):
    prompts = []
    for i in range(count):
        length = rng.randint(1, 90)
        routing = np.array([[[rng.randrange(experts) for _ in range(top_k)]
                             for _ in range(layers)] for _ in range(length)], dtype=np.int64)
        bad = np.array([-1, experts, experts + 9] + ([(1 << 40) + 1] if id64 else []),
                       dtype=np.int64)
        mask = np.array([[[rng.random() < bad_rate for _ in range(top_k)] for _ in range(layers)]
                         for _ in range(length)])
        routing[mask] = bad[np.arange(mask.sum()) % len(bad)]
        source, shared = None, 0
        if i > 0 and rng.random() < 0.4:
            candidate = rng.randrange(i)
            full = prompts[candidate][0].shape[0] // block_size
            if full > 0:
                source, shared = candidate, rng.randint(1, full)
                prefix = prompts[candidate][0][:shared * block_size]
                routing = np.concatenate([prefix, routing])
        prompts.append((routing, source, shared))
    return prompts


class CaptureCtypesTest(unittest.TestCase):

    def test_library_identity(self):
        library = eldr_capture.load_library()
        self.assertEqual(library.version_string(), "0.1.0")
        available, reason = library.cuda_status()
        if not available:
            self.assertIn("no usable GPU", reason)

    def test_random_engine_matches_bincount(self):
        for id_dtype, slot_dtype, block_size, top_k in [(np.int32, np.int64, 16, 2),
                                                        (np.int64, np.int32, 5, 4),
                                                        (np.int64, np.int64, 32, 8)]:
            with self.subTest(ids=id_dtype.__name__, slots=slot_dtype.__name__,
                              block_size=block_size):
                layers, experts = 4, 20
                rng = random.Random(block_size)
                prompts = random_prompts(rng, 30, layers, experts, top_k, block_size, 0.03,
                                         id_dtype == np.int64)
                num_blocks = sum(p[0].shape[0] for p in prompts) // block_size + 64
                with CaptureContext(layers, experts, max_top_k=top_k, num_blocks=num_blocks,
                                    block_size=block_size, max_finish_requests=8) as ctx:
                    engine = PagedEngine(self, ctx, layers=layers, experts=experts, top_k=top_k,
                                         block_size=block_size, num_blocks=num_blocks,
                                         id_dtype=id_dtype, slot_dtype=slot_dtype, seed=3)
                    engine.run(prompts)
                    self.assertEqual(engine.finished, 30)
                    self.assertGreater(engine.reused, 5)
                    self.assertGreater(engine.shared_blocks, 0)
                    stats = ctx.stats()
                    self.assertEqual(stats["bad_expert_ids"], engine.expected_bad_ids)
                    self.assertGreater(engine.expected_bad_ids, 0)
                    self.assertEqual(stats["padding_tokens"], engine.expected_padding)
                    self.assertEqual(stats["duplicate_slots"], 0)
                    self.assertEqual(stats["bad_block_ids"], 0)

    def test_real_traces_match_bincount(self):
        data = os.path.join(os.environ.get("ELDR_DATA_DIR", "data"), "esft-routing")
        topk = np.load(os.path.join(data, "law_topk.npy"))
        offsets = np.load(os.path.join(data, "law_offsets.npy"))
        self.assertEqual(topk.dtype, np.uint8)
        layers, top_k = topk.shape[1], topk.shape[2]
        prompts = []
        for s in range(6):
            prompts.append((topk[offsets[s]:offsets[s + 1]].astype(np.int64), None, 0))
        # A request sharing the first 3 blocks of sequence 0, then sequence 6's tokens.
        prefix = prompts[0][0][:48]
        prompts.append((np.concatenate([prefix, topk[offsets[6]:offsets[7]]]).astype(np.int64),
                        0, 3))
        num_blocks = sum(p[0].shape[0] for p in prompts) // 16 + 32
        with CaptureContext(layers, 64, max_top_k=top_k, num_blocks=num_blocks, block_size=16,
                            max_finish_requests=4) as ctx:
            engine = PagedEngine(self, ctx, layers=layers, experts=64, top_k=top_k, block_size=16,
                                 num_blocks=num_blocks, id_dtype=np.int32, slot_dtype=np.int64,
                                 seed=9)
            engine.run(prompts)
            self.assertEqual(engine.finished, 7)
            self.assertEqual(engine.shared_blocks, 3)
            stats = ctx.stats()
            total = sum(p[0].shape[0] for p in prompts) - 48  # the shared prefix is not recomputed
            self.assertEqual(stats["recorded_choices"], total * layers * top_k)

    def test_int16_output_and_uint8_input(self):
        with CaptureContext(1, 4, max_top_k=1, num_blocks=4, block_size=16) as ctx:
            ids = np.array([[3], [3], [1]], dtype=np.uint8)  # converted to int32 by the binding
            ctx.record(0, ids, [0, 1, 2])
            with ctx.finish([[0]], [3]) as result:
                counts = result.counts()
            self.assertEqual(counts.dtype, np.dtype("<i2"))
            np.testing.assert_array_equal(counts, [[[0, 1, 0, 2]]])

    def test_direct_mode(self):
        with CaptureContext(2, 5, max_top_k=2, max_direct_requests=3) as ctx:
            ids = np.array([[0, 4], [4, 4], [2, 9], [1, 1]], dtype=np.int64)
            ctx.record_direct(1, ids, np.array([2, 0, 2, -1], dtype=np.int32))
            with ctx.finish_direct([2, 0], output="int32") as result:
                counts = result.counts()
                stats = result.stats()
            np.testing.assert_array_equal(counts[0], [[0, 0, 0, 0, 0], [1, 0, 1, 0, 1]])
            np.testing.assert_array_equal(counts[1], [[0, 0, 0, 0, 0], [0, 0, 0, 0, 2]])
            self.assertEqual(stats["bad_expert_ids"], 1)
            self.assertEqual(stats["padding_tokens"], 1)
            # Finishing zeroed the slots.
            with ctx.finish_direct([2], output="int32") as again:
                self.assertEqual(int(again.counts().sum()), 0)

    def test_errors_name_the_problem(self):
        with self.assertRaises(CaptureError) as error:
            CaptureContext(0, 4, num_blocks=4, block_size=4)
        self.assertEqual(error.exception.name, "INVALID_ARGUMENT")
        self.assertIn("num_layers and num_experts must be > 0", error.exception.message)
        with CaptureContext(2, 4, max_top_k=2, num_blocks=4, block_size=4, result_slots=1) as ctx:
            with self.assertRaises(CaptureError) as error:
                ctx.record(2, np.zeros((1, 2), np.int32), np.zeros(1, np.int64))
            self.assertIn("layer 2 is outside [0, 2)", str(error.exception))
            with self.assertRaises(CaptureError) as error:
                ctx.finish([[0]], [5])
            self.assertIn("more than its block table holds", str(error.exception))
            held = ctx.finish([[0]], [1])
            with self.assertRaises(CaptureError) as error:
                ctx.finish([[0]], [1])
            self.assertEqual(error.exception.name, "RESOURCE_EXHAUSTED")
            held.release()
            ctx.finish([[0]], [1]).release()
        with self.assertRaises(CaptureError) as error:
            CaptureContext(2, 4, device="cuda", num_blocks=4, block_size=4)
        if not eldr_capture.load_library().cuda_status()[0]:
            self.assertEqual(error.exception.name, "UNAVAILABLE")

    def test_block_counts_and_reset(self):
        with CaptureContext(1, 3, max_top_k=1, num_blocks=2, block_size=2) as ctx:
            ctx.record(0, [[2], [2]], [2, 3])
            np.testing.assert_array_equal(ctx.read_block_counts(1, 1), [[[0, 0, 2]]])
            ctx.record(0, [[0]], [2])  # offset 0 again: the block is refilled
            np.testing.assert_array_equal(ctx.read_block_counts(1, 1), [[[1, 0, 0]]])
            self.assertEqual(ctx.info()["counter_bits"], 8)


class GateProbSumsCtypesTest(unittest.TestCase):
    """Gate-probability sums through the binding on real routing (the bundled summary prompts,
    273..1402 tokens) with random top-6 weights that sum to 1 per token: the library's fixed-point
    sums against the exact (float64) sums, beside a plain float32 accumulation in token order."""

    def test_fixed_point_sums_are_closer_to_exact_than_float32_accumulation(self):
        data = os.path.join(os.environ.get("ELDR_DATA_DIR", "data"), "esft-routing")
        topk = np.load(os.path.join(data, "summary_topk.npy"))
        offsets = np.load(os.path.join(data, "summary_offsets.npy"))
        rng = np.random.default_rng(0)
        worst_fixed = worst_float32 = 0.0
        for s in range(3):
            rows = topk[offsets[s]:offsets[s + 1]].astype(np.int32)
            n = len(rows)
            weights = rng.dirichlet(np.ones(6), size=(n, 26)).astype(np.float32)
            blocks = (n + 15) // 16
            ctx = CaptureContext(26, 64, max_top_k=6, num_blocks=blocks, block_size=16,
                                 record_gate_probs=1)
            self.assertEqual(ctx.info()["gate_prob_fraction_bits"], 24)
            slots = np.arange(n, dtype=np.int64)
            for layer in range(26):
                ctx.record_gate_probs(layer, rows[:, layer, :], weights[:, layer, :], slots)
            with ctx.finish_gate_probs(np.arange(blocks, dtype=np.int32), [n]) as result:
                got = result.gate_prob_sums()[0].astype(np.float64)
            with ctx.finish(np.arange(blocks, dtype=np.int32), [n], output="int32") as result:
                counts = result.counts()[0]
            exact = np.zeros((26, 64))
            float32 = np.zeros((26, 64), dtype=np.float32)
            for layer in range(26):
                ids = rows[:, layer, :].ravel()
                w = weights[:, layer, :].ravel()
                np.add.at(exact[layer], ids, w.astype(np.float64))
                for i, p in zip(ids, w):
                    float32[layer, i] = np.float32(float32[layer, i] + p)
            # Rows total the prompt's tokens (weights sum to 1 per token and layer).
            np.testing.assert_allclose(got.sum(axis=1), n, rtol=1e-5)
            # The documented bound: n probabilities rounded to 2^-24, then one float32 rounding.
            bound = counts * 2.0 ** -25 + np.abs(exact) * 2.0 ** -24
            self.assertTrue(np.all(np.abs(got - exact) <= bound + 1e-12))
            worst_fixed = max(worst_fixed, float(np.max(np.abs(got - exact))))
            worst_float32 = max(worst_float32, float(np.max(np.abs(float32 - exact))))
        print(f"\ngate sums, max |error| vs exact: fixed point {worst_fixed:.3g}, "
              f"float32 accumulation {worst_float32:.3g}", file=sys.stderr)
        self.assertLess(worst_fixed, worst_float32)


class GateLogitsCtypesTest(unittest.TestCase):
    """The gate_prob_all capture (softmax over all experts of router logits) through the binding,
    against numpy's softmax on real routing of the bundled prompts with random logits: blocks
    reused from offset 0, non-finite rows counted, float16 rows, the direct mode."""

    @staticmethod
    def quantised_softmax(logits: np.ndarray) -> np.ndarray:
        """round(softmax * 2^24) per row, in float64 (numpy), as integers of the 2^-24 grid."""
        x = logits.astype(np.float64)
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return np.rint(e / e.sum(axis=-1, keepdims=True) * 2.0 ** 24)

    def test_sums_equal_numpy_softmax_over_all_experts(self):
        data = os.path.join(os.environ.get("ELDR_DATA_DIR", "data"), "esft-routing")
        topk = np.load(os.path.join(data, "summary_topk.npy"))
        offsets = np.load(os.path.join(data, "summary_offsets.npy"))
        rows = topk[offsets[0]:offsets[1]].astype(np.int32)
        n, layers, experts = len(rows), 4, 64
        rng = np.random.default_rng(3)
        logits = rng.normal(0.0, 2.5, size=(n, layers, experts)).astype(np.float32)
        logits[7, 1, 5] = np.nan
        logits[8, 2, 0] = np.inf
        blocks = (n + 15) // 16
        ctx = CaptureContext(layers, experts, max_top_k=6, num_blocks=blocks, block_size=16,
                             record_gate_probs=1)
        slots = np.arange(n, dtype=np.int64)
        # A first fill of block 0 with other logits, then the prompt refills it from offset 0.
        ctx.record_gate_logits(0, rows[:16, 0, :], np.zeros((16, experts), np.float32), slots[:16])
        for layer in range(layers):
            ctx.record_gate_logits(layer, rows[:, layer, :], logits[:, layer, :], slots)
        with ctx.finish_gate_probs(np.arange(blocks, dtype=np.int32), [n]) as result:
            got = result.gate_prob_sums()[0].astype(np.float64)
            stats = result.stats()
        self.assertEqual(stats["bad_gate_probs"], 2)
        want = np.zeros((layers, experts))
        for layer in range(layers):
            q = self.quantised_softmax(logits[:, layer, :])
            q[~np.isfinite(logits[:, layer, :]).all(axis=1)] = 0
            want[layer] = q.sum(axis=0) * 2.0 ** -24
        # At most one grid step per token (a probability on a rounding boundary) + float32 rounding.
        np.testing.assert_allclose(got, want, rtol=2 ** -23, atol=n * 2.0 ** -24)
        self.assertGreaterEqual(np.mean(got == want.astype(np.float32)), 0.99)
        # Every expert gets probability, not only the chosen ones; rows total the finite tokens.
        self.assertTrue(np.all(got > 0))
        np.testing.assert_allclose(got.sum(axis=1), [n, n - 1, n - 1, n], rtol=1e-5)
        # The counts are still the top-k counts.
        with ctx.finish(np.arange(blocks, dtype=np.int32), [n], output="int32") as result:
            self.assertEqual(int(result.counts()[0].sum()), layers * n * 6)

    def test_float16_rows_and_the_direct_mode(self):
        ctx = CaptureContext(1, 4, max_top_k=1, num_blocks=1, block_size=4, max_direct_requests=2,
                             record_gate_probs=1)
        logits = np.array([[0, 0, -1000, -1000], [0, 0, 0, 0]], dtype=np.float16)
        ids = np.array([[0], [1]], dtype=np.int32)
        ctx.record_gate_logits(0, ids, logits, [0, 1])
        with ctx.finish_gate_probs([[0]], [2]) as result:
            np.testing.assert_array_equal(result.gate_prob_sums()[0][0], [0.75, 0.75, 0.25, 0.25])
        ctx.record_direct_gate_logits(0, ids, logits.astype(np.float32), [1, -1])
        with ctx.finish_direct_gate_probs([1]) as result:
            np.testing.assert_array_equal(result.gate_prob_sums()[0][0], [0.5, 0.5, 0, 0])
        with self.assertRaises(ValueError):
            ctx.record_gate_logits(0, ids, np.zeros((2, 3), np.float32), [0, 1])


class RouterClientCtypesTest(unittest.TestCase):

    def setUp(self):
        binary = os.environ.get("ELDR_CAPTURE_FAKE_ROUTER")
        if not binary:
            self.fail("ELDR_CAPTURE_FAKE_ROUTER is not set")
        self.router = subprocess.Popen([binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True)
        line = self.router.stdout.readline().split()
        if len(line) != 2 or line[0] != "PORT":
            self.router.kill()
            self.fail(f"fake router did not start: {line}")
        self.target = f"127.0.0.1:{line[1]}"

    def tearDown(self):
        self.router.stdin.close()
        self.router.stdout.close()
        try:
            self.router.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.router.kill()
            self.router.wait()

    def test_route_and_complete(self):
        with RouterClient(self.target, timeout_ms=2000) as client:
            counts = np.array([[0, 1, 2], [40, 3, 2]], dtype=np.int16)  # argmax 3 -> decode-0
            decision = client.route(counts, request_id="py-1", prompt_tokens=12)
            self.assertEqual(decision.worker_id, "decode-0")
            self.assertEqual(decision.policy, "eldr")
            self.assertEqual(decision.band_size, 2)
            self.assertAlmostEqual(decision.similarity, 0.75)
            wide = client.route(np.array([[1, 70000, 3]], dtype=np.int64))  # argmax 1
            self.assertEqual(wide.worker_id, "decode-1")
            client.complete(decision.lease_id, 5)
            with self.assertRaises(CaptureError) as error:
                client.complete(decision.lease_id)
            self.assertEqual(error.exception.name, "NOT_FOUND")
            unsigned = client.route(None)
            self.assertEqual(unsigned.fallback_reason, "no_signature")
            with self.assertRaises(CaptureError) as error:
                client.route(counts, request_id="reject")
            self.assertEqual(error.exception.name, "INVALID_ARGUMENT")
            self.assertIn("counts rejected by the fake router", error.exception.message)


if __name__ == "__main__":
    unittest.main()
