"""Operational timings of eldr-router run as its standalone Kubernetes container (same command,
args and mounted files as live_daemon_test.py, on loopback; the decode pods of
deploy/examples/decode-statefulset.yaml on a stand-in API server reached with --kubeconfig),
printed as one JSON object:

  startup_to_serving_s       process start until the startup probe passes (decode pods listed
                             and added, artifact loaded)
  pod_ready_to_active_s      a new Ready decode pod until it is active in the pool
                             (--discovery_settle included)
  pod_unready_to_draining_s  a decode pod turning unready until it is draining
  pod_deleted_to_removed_s   a decode pod deleted until it has left the pool
  configmap_to_reload_s      a kubelet-style ConfigMap swap until eldr_centroid_generation moves
  sigterm_to_exit_s          SIGTERM with no RPC in flight until the process has exited 0

Each figure is the median of --runs runs. By hand:
  ELDR_BIN_DIR=build/bin /usr/bin/python3 tests/deploy/measure_operations.py --runs 5
"""

import argparse
import json
import os
import signal
import statistics
import time

import deploy_testlib as lib


def timed(change, done, what):
    """Seconds from `change()` until `done()` holds (polled every 10 ms)."""
    started = time.monotonic()
    change()
    lib.wait_until(lambda: done() or "not yet", timeout=30, interval=0.01, what=what)
    return time.monotonic() - started


def one_run(objects, workload, spec, container_spec):
    flags = lib.flag_values(container_spec["args"])
    fake = lib.FakeVllmMetrics([])
    cluster = lib.DecodePods(workload["metadata"]["namespace"], fake,
                             port_names={flags.get("worker_port", "http"),
                                         flags.get("worker_metrics_port") or flags.get("worker_port", "http")})
    container = lib.PodContainer(objects, spec, container_spec,
                                 extra_args=[f"--kubeconfig={cluster.kubeconfig}"])
    try:
        names = cluster.create_pool()
        started = time.monotonic()
        container.start()
        container.pass_probe("startupProbe")
        startup = time.monotonic() - started

        pb = lib.protobuf_modules()
        import grpc
        channel = grpc.insecure_channel(f"127.0.0.1:{container.listen_port('admin_listen')}")
        list_workers = channel.unary_unary("/eldr.v1.RouterAdmin/ListWorkers",
                                           request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=pb.ListWorkersResponse.FromString)

        def state(name):
            for w in list_workers(pb.ListWorkersRequest(), timeout=5).workers:
                if w.worker.id == name:
                    return w.state
            return None
        joined = f"{cluster.prefix}-{len(names)}"
        added = timed(lambda: cluster.create(joined), lambda: state(joined) == "active",
                      f"{joined} active")
        drained = timed(lambda: cluster.set_ready(joined, False),
                        lambda: state(joined) == "draining", f"{joined} draining")
        removed = timed(lambda: cluster.delete(joined), lambda: state(joined) is None,
                        f"{joined} removed")
        channel.close()

        centroids = flags["centroids"]
        folder = container.local_path(os.path.dirname(centroids))
        key = os.path.basename(centroids)
        with open(os.path.join(folder, key)) as f:
            artifact = json.load(f)
        metrics_url = f"http://127.0.0.1:{container.listen_port('metrics_listen')}/metrics"

        def generation():
            samples = lib.parse_exposition(lib.http_get(metrics_url)[1])
            return samples["eldr_centroid_generation"][0][1]
        before = generation()
        swapped = time.monotonic()
        lib.update_projected_volume(folder, {key: json.dumps(dict(artifact, seed=7)).encode()})
        lib.wait_until(lambda: generation() > before or "unchanged", timeout=30, interval=0.02,
                       what="the reload")
        reload = time.monotonic() - swapped

        stopping = time.monotonic()
        container.process.send_signal(signal.SIGTERM)
        code = container.process.wait(timeout=60)
        stop = time.monotonic() - stopping
        if code != 0:
            raise AssertionError(f"exit code {code}\n{container.log()}")
        return startup, added, drained, removed, reload, stop
    finally:
        container.cleanup()
        cluster.close()
        fake.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    lib.require_binary("eldr-router")
    objects = lib.render_overlay("standalone")
    workload, spec, container_spec = lib.router_workload(objects)
    runs = [one_run(objects, workload, spec, container_spec) for _ in range(args.runs)]
    names = ("startup_to_serving_s", "pod_ready_to_active_s", "pod_unready_to_draining_s",
             "pod_deleted_to_removed_s", "configmap_to_reload_s", "sigterm_to_exit_s")
    result = {"runs": args.runs}
    for name, values in zip(names, zip(*runs)):
        result[name] = round(statistics.median(values), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
