"""Peer: TensorFlow ParameterServerStrategy on localhost, 1 PS and W workers, MLP 64-H-H-10, batch 32.

Usage: python tf_ps.py RESULT_JSON WORKERS STEPS [HIDDEN]
Writes steps/s and the optimizer's own iteration count (TF's global step) after STEPS timed steps.
"""

import json
import multiprocessing
import os
import socket
import sys
import time

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["GRPC_FAIL_FAST"] = "use_caller"


def free_ports(count: int) -> list[int]:
    """Distinct free ports: every socket stays bound until all are picked."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_servers(num_workers: int, num_ps: int = 1, attempts: int = 3) -> tuple[dict, list[multiprocessing.Process]]:
    """The cluster's worker and PS servers, listening; a server that fails to bind (a port taken meanwhile) makes
    it start again on other ports."""
    for _ in range(attempts):
        ports = free_ports(num_workers + num_ps + 1)
        cluster = {
            "worker": [f"localhost:{port}" for port in ports[:num_workers]],
            "ps": [f"localhost:{port}" for port in ports[num_workers:-1]],
            "chief": [f"localhost:{ports[-1]}"],
        }
        servers = [
            multiprocessing.Process(target=serve, args=(cluster, "worker", i), daemon=True) for i in range(num_workers)
        ]
        servers += [multiprocessing.Process(target=serve, args=(cluster, "ps", i), daemon=True) for i in range(num_ps)]
        for p in servers:
            p.start()
        deadline = time.monotonic() + 120
        waiting = list(ports[:-1])
        while waiting and all(p.is_alive() for p in servers) and time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", waiting[0])) == 0:
                    waiting.pop(0)
                    continue
            time.sleep(0.2)
        if not waiting:
            return cluster, servers
        for p in servers:
            p.kill()
    raise RuntimeError(f"TensorFlow's servers did not start in {attempts} attempts")


def serve(cluster: dict, job: str, index: int) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc")
    server.join()


def main() -> None:
    result_path, num_workers, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hidden = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    warmup = 50
    cluster, servers = start_servers(num_workers)
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input((64,)),
                tf.keras.layers.Dense(hidden, activation="relu"),
                tf.keras.layers.Dense(hidden, activation="relu"),
                tf.keras.layers.Dense(10),
            ]
        )
        optimizer = tf.keras.optimizers.SGD(0.01)

    def dataset_fn():
        x = tf.random.uniform((4096, 64))
        y = tf.random.uniform((4096,), maxval=10, dtype=tf.int64)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32).prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(it):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
            return loss

        x, y = next(it)
        return strategy.run(replica, args=(x, y))

    for _ in range(warmup):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    started = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    elapsed = time.perf_counter() - started
    with open(result_path, "w") as f:
        json.dump(
            {
                "steps_per_s": steps / elapsed,
                "scheduled": steps + warmup,
                "iterations": int(optimizer.iterations),
            },
            f,
        )
    for p in servers:
        p.kill()
    os._exit(0)


if __name__ == "__main__":
    main()
