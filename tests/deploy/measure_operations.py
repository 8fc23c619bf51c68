"""Operational timings of eldr-router run as its standalone Kubernetes container (same command,
args and mounted files as live_daemon_test.py, on loopback), printed as one JSON object:

  startup_to_serving_s    process start until the startup probe passes (artifact loaded)
  configmap_to_reload_s   a kubelet-style ConfigMap swap until eldr_centroid_generation moves
  sigterm_to_exit_s       SIGTERM with no RPC in flight until the process has exited 0

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


def one_run(objects, spec, container_spec, workers):
    fake = lib.FakeVllmMetrics(workers)
    container = lib.PodContainer(objects, spec, container_spec,
                                 rewrite_files={"workers.json": fake.rewrite_workers_json})
    try:
        started = time.monotonic()
        container.start()
        container.pass_probe("startupProbe")
        startup = time.monotonic() - started

        centroids = lib.flag_values(container_spec["args"])["centroids"]
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
        return startup, reload, stop
    finally:
        container.cleanup()
        fake.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    lib.require_binary("eldr-router")
    objects = lib.render_overlay("standalone")
    _, spec, container_spec = lib.router_workload(objects)
    config_map = next(o for o in lib.find(objects, "ConfigMap")
                      if o["metadata"]["name"].startswith("eldr-router-workers"))
    workers = [w["id"] for w in json.loads(config_map["data"]["workers.json"])["workers"]]
    runs = [one_run(objects, spec, container_spec, workers) for _ in range(args.runs)]
    startup, reload, stop = (statistics.median(values) for values in zip(*runs))
    print(json.dumps({"runs": args.runs, "startup_to_serving_s": round(startup, 3),
                      "configmap_to_reload_s": round(reload, 3),
                      "sigterm_to_exit_s": round(stop, 3)}))


if __name__ == "__main__":
    main()
