"""`python -m bench.gpu COMMAND`: the 4b synthetic checkpoint measured on a GPU in a few plain
commands, each writing its JSON (every run kept) and printing its table; `--tiny` runs the same
on the CPU with the tiny preset in float32.

    build     the checkpoint and the torch engine directory with its compiler caches
    latency   the `omnijev bench` workloads in process: whole-request median, p90, every run
    parity    float32 and BF16 engines, and the BF16 reference, against the float32 reference
    cold      process start to /health 200, with and without the engine directory's caches
    serve     `omnijev serve` (prefix cache off) under closed-loop HTTP load (bench.load)
    batches   the traffic suite's requests alone and batched in process: bytes, times, builds
    sizes     the first request about each of 10 image sizes not warmed, against it warm
    plans     the packed pass plans of the suite: passes, token slots filled, packed sizes;
              with --times, a sizes record's requests planned and their warm times fitted

Every setting is a RuntimeConfig or an `omnijev` option; nothing is patched.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench import hoststages, load, traffic
from bench.latency import latency, latency_table
from bench.parity import parity, parity_table, without_latency
from bench.workloads import bench_bodies, host_requests, parity_images, question_sets, workloads
from bench.workloads import body as request_body

WORK = Path("/tmp/omnijev")  # checkpoints, engine directories and logs of this machine
OUT = "/tmp/omnijev-out"  # the records, unless --out or $OUT
SEED = 0  # the synthetic checkpoint's
RUNS = 20  # warm runs a workload
REFERENCE_RUNS = 10  # the reference's runs a workload
READY_LIMIT_S = 600  # a server start, compilation without caches included
PORT = 8011
LOG_TAIL = 4000  # characters of a server's log kept in the record


@dataclass(frozen=True)
class Machine:
    """Where and what: the preset, its device and dtype, and the work folder."""

    preset: str
    device: str
    dtype: str
    work: Path
    out: Path

    @property
    def checkpoint(self) -> Path:
        return self.work / f"{self.preset}-export"

    def engines(self, dtype: str | None = None, name: str = "") -> Path:
        return self.work / f"engines-{self.preset}-{dtype or self.dtype}{name}"

    def save(self, name: str, record: dict) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / name
        path.write_text(json.dumps(record, indent=1, default=str))
        return path


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def environment() -> dict:
    """The commit, the command and the machine: what a record needs to be read again."""
    import torch

    commit = os.environ.get("BENCH_COMMIT")  # a working tree copied without its .git
    if not commit and shutil.which("git"):
        found = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = found.stdout.strip() or None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "commit": commit,
        "command": sys.argv,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


# -- build -------------------------------------------------------------------------------------


def warm_bodies(m: Machine) -> list[bytes]:
    """The bench workloads and one traffic request of every image size (the warm-up stream)."""
    sizes = [traffic.request(SEED, i, "warm-up").body for i in range(len(traffic.SIZES))]
    return [*bench_bodies().values(), *(sizes if m.device == "cuda" else [])]


def build_checkpoint(m: Machine) -> float:
    """The preset's synthetic export (its release beside it dropped); seconds it took."""
    from build_engines.checkpoints import make_checkpoint, release_path

    if m.checkpoint.exists():
        return 0.0
    started = time.perf_counter()
    make_checkpoint(m.preset, SEED, m.checkpoint)
    shutil.rmtree(release_path(m.checkpoint), ignore_errors=True)
    return time.perf_counter() - started


def build_engines(m: Machine, dtype: str | None = None, name: str = "", caches: bool = True):
    """An engine directory for the torch backend (no ONNX files), its compiler caches filled
    on a GPU; the caches' record, or None."""
    from build_engines.engines import MANIFEST, build_torch_artifacts, torch_engine_dir

    folder = m.engines(dtype, name)
    manifest = folder / MANIFEST
    if not manifest.exists():
        torch_engine_dir(m.checkpoint, folder, dtype or m.dtype)
    if not caches or m.device != "cuda" or "torch" in json.loads(manifest.read_text()):
        return None
    return build_torch_artifacts(m.checkpoint, folder, dtype or m.dtype, warm_bodies(m))


def build(m: Machine, args) -> dict:
    """The checkpoint and the engine directory, where missing; recorded when anything was made."""
    record = {"environment": environment(), "checkpoint_s": build_checkpoint(m)}
    started = time.perf_counter()
    record["torch_caches"] = build_engines(m)
    record["engines_s"] = time.perf_counter() - started
    if record["checkpoint_s"] or record["torch_caches"]:
        m.save("build.json", record)
    print(f"checkpoint {record['checkpoint_s']:.1f} s, engines {record['engines_s']:.1f} s")
    return record


# -- in process --------------------------------------------------------------------------------


def executor_for(m: Machine, engines: Path):
    """The torch backend on the machine's device, the prefix cache off (every bench request
    sends the same still)."""
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine

    config = RuntimeConfig(backend="torch", device=m.device, prefix_cache=0)
    return load_engine(str(m.checkpoint), str(engines), config)


def release() -> None:
    """Frees what a dropped executor or reference held on the device before the next loads."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def latency_command(m: Machine, args) -> dict:
    from server.app import worker_process

    build(m, args)
    worker_process()  # timed in a process set up as the worker's (GIL interval, threads)
    started = time.perf_counter()
    executor = executor_for(m, m.engines())
    record = {"environment": environment(), "load_s": time.perf_counter() - started}
    record["rows"] = latency(executor, None, args.runs, args.workload)
    hosted = {name: body for name, body in host_requests().items() if chosen(name, args)}
    record["host_stages_ms"] = hoststages.profile(hosted, args.runs, executor)
    del executor
    release()
    if args.reference:  # the reference in the engine's dtype (fla-core's kernels if importable)
        from reference.mso1 import Reference

        reference = Reference(m.checkpoint, dtype=m.dtype, device=m.device)
        record["reference"] = reference_rows(reference, args)
        del reference
        release()
        for row, theirs in zip(record["rows"], record["reference"], strict=True):
            row["reference_median_ms"] = theirs["median_ms"]
            row["speedup"] = theirs["median_ms"] / row["median_ms"]
    m.save("latency.json", record)
    print(latency_table(record["rows"]))
    print(hoststages.table(record["host_stages_ms"]))
    return record


def chosen(name: str, args) -> bool:
    """Whether a workload (or a host request, "PNG 1 question") is among `--workload`'s."""
    return not args.workload or any(name.endswith(w) for w in args.workload)


def reference_rows(reference, args) -> list[dict]:
    from bench.latency import time_runs
    from bench.workloads import quantile

    rows = []
    for name, request in bench_bodies(args.workload).items():
        times = time_runs(reference.answer, request, min(args.runs, REFERENCE_RUNS))
        rows.append(
            {
                "workload": name,
                "median_ms": 1e3 * statistics.median(times),
                "p90_ms": 1e3 * quantile(times, 0.9),
                "runs_ms": [round(1e3 * t, 3) for t in times],
            }
        )
    return rows


class Recorded:
    """The reference's answers computed in another process, looked up by request body."""

    def __init__(self, path: Path):
        self.answers = json.loads(path.read_text())

    def answer(self, body: bytes) -> dict:
        return self.answers[hashlib.sha256(body).hexdigest()]


def reference_answers(m: Machine, args) -> None:
    """(run by `parity` in a process without fla-core, whose Triton dots round float32 operands
    to TF32) the float32 reference's answer to every parity request, by the body's sha256."""
    from reference.mso1 import Reference

    reference = Reference(m.checkpoint, dtype="float32", device=m.device)
    answers = {}
    for _, image, mime in parity_images():
        for questions in question_sets().values():
            body = request_body(image, mime, questions)
            answers[hashlib.sha256(body).hexdigest()] = reference.answer(body)
    Path(args.answers).write_text(json.dumps(answers))


def without_fla() -> dict[str, str]:
    """This environment with fla-core's folder (FLA_PATH) off the module path."""
    fla = os.environ.get("FLA_PATH", "")
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and p != fla]
    return {**os.environ, "PYTHONPATH": ":".join(parts)}


def parity_command(m: Machine, args) -> dict:
    build_checkpoint(m)
    recorded = m.work / f"reference-{m.preset}-float32.json"
    if not recorded.exists():
        command = [sys.executable, "-m", "bench.gpu", "reference-answers", *common(m)]
        subprocess.run([*command, "--answers", str(recorded)], env=without_fla(), check=True)
    record = {"environment": environment()}
    for dtype in dict.fromkeys(("float32", m.dtype)):
        build_engines(m, dtype)
        executor = executor_for(m, m.engines(dtype))
        report = parity(executor, Recorded(recorded), question_sets())
        record[f"engine_{dtype}"] = report
        print(f"engine {dtype}\n{parity_table(report)}")
        del executor
        release()
    if m.dtype != "float32":  # how far BF16 alone moves the answers
        from reference.mso1 import Reference

        reference = Reference(m.checkpoint, dtype=m.dtype, device=m.device)
        report = parity(reference, Recorded(recorded), question_sets())
        record[f"reference_{m.dtype}"] = report
        print(f"reference {m.dtype}\n{parity_table(report)}")
        del reference
        release()
    m.save("parity.json", record)
    return record


# -- over HTTP ---------------------------------------------------------------------------------


def warm_files(m: Machine) -> list[str]:
    """`--warm-up` options naming the warm-up bodies, written into the work folder."""
    options = []
    for index, body in enumerate(warm_bodies(m)):
        path = m.work / f"warm-{index}.json"
        path.write_bytes(body)
        options += ["--warm-up", str(path)]
    return options


def start_server(m: Machine, engines: Path, log_path: Path, env: dict | None = None):
    """`omnijev serve` on the checkpoint, prefix cache off, warmed on `warm_files`: (process,
    seconds from its start to /health 200)."""
    command = [sys.executable, "-m", "runtime.cli", "serve", "--checkpoint", str(m.checkpoint)]
    command += ["--engines", str(engines), "--port", str(PORT), "--prefix-cache", "0"]
    command += ["--device", m.device, "--backend", "torch", *warm_files(m)]
    started = time.perf_counter()
    with log_path.open("wb") as output:
        server = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        return server, wait_ready(server, started)
    except BaseException:
        stop(server)
        raise


def wait_ready(server: subprocess.Popen, started: float) -> float:
    while time.perf_counter() - started < READY_LIMIT_S:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url()}/health", timeout=2) as answer:
                if answer.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {READY_LIMIT_S} s")


def base_url() -> str:
    return f"http://127.0.0.1:{PORT}"


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def bench_answer() -> dict:
    """The 12-question bench request's answers over HTTP, without their latency fields."""
    body = bench_bodies()["12 questions"]
    headers = {"Content-Type": "application/json"}
    post = urllib.request.Request(f"{base_url()}/v1/systemone", body, headers)
    with urllib.request.urlopen(post, timeout=120) as answer:
        return without_latency(json.loads(answer.read()))


def cold_command(m: Machine, args) -> dict:
    """Two starts, each into an empty user cache folder: on an engine directory without
    caches and with no compiler cache anywhere (every warm-up shape compiled), then on the one
    `build` made (its caches copied and loaded)."""
    build(m, args)
    bare = m.engines(name="-bare")
    shutil.rmtree(bare, ignore_errors=True)
    build_engines(m, name="-bare", caches=False)
    record = {"environment": environment()}
    for label, engines in (("without_caches", bare), ("with_caches", m.engines())):
        empty = m.work / f"empty-{label}"
        shutil.rmtree(empty, ignore_errors=True)
        env = {"XDG_CACHE_HOME": str(empty / "home")}
        if engines == bare:  # not even the compilers' default folders of an earlier run
            env.update(TORCHINDUCTOR_CACHE_DIR=str(empty / "inductor"))
            env.update(TRITON_CACHE_DIR=str(empty / "triton"))
        m.out.mkdir(parents=True, exist_ok=True)
        server, ready = start_server(m, engines, m.out / f"cold-{label}.log", env)
        try:
            record[label] = {"ready_s": ready, "answers": bench_answer()}
        finally:
            stop(server)
        log(f"cold start {label}: {ready:.1f} s")
    record["same_answers"] = record["without_caches"]["answers"] == record["with_caches"]["answers"]
    m.save("cold.json", record)
    print("| start | seconds to /health 200 |\n| --- | ---: |")
    for label in ("without_caches", "with_caches"):
        print(f"| {label.replace('_', ' ')} | {record[label]['ready_s']:.1f} |")
    return record


def serve_command(m: Machine, args) -> dict:
    build(m, args)
    log_path = m.work / "server.log"
    server, ready = start_server(m, m.engines(), log_path)
    record = {"environment": environment(), "ready_s": ready, "runs": []}
    log(f"server ready in {ready:.1f} s")
    try:
        options = ["--url", f"{base_url()}/v1/systemone", "--suite", args.suite]
        options += ["--seed", str(args.seed), "--requests", str(args.requests)]
        options += ["--warm-up", str(args.warm_up), "--clients", args.clients]
        options += ["--out", str(m.out / f"load-{run_name(args)}.json")]
        if args.questions:
            options += ["--questions", str(args.questions)]
        record["load_exit"] = load.main(options)
        record["gpu_memory"] = gpu_memory()  # after the last run: every shape it built held
        print(f"GPU memory after the runs: {record['gpu_memory']}")
    finally:
        stop(server)
        record["server_log_tail"] = log_path.read_text(errors="replace")[-LOG_TAIL:]
    m.save(f"serve-{run_name(args)}.json", record)
    return record


def gpu_memory() -> dict:
    """The running server's CUDA memory: torch's allocated and reserved bytes (its /metrics),
    and the device's memory in use, context and all (nvidia-smi, MiB), where it can be read."""
    found: dict = {}
    try:
        with urllib.request.urlopen(f"{base_url()}/metrics", timeout=5) as answer:
            found.update(cuda_memory(answer.read().decode()))
    except (urllib.error.URLError, OSError) as error:
        found["metrics_error"] = str(error)
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        done = subprocess.run(query, capture_output=True, text=True)
        found["device_used_mib"] = done.stdout.strip() or done.stderr.strip()
    return found


def cuda_memory(metrics: str) -> dict[str, float]:
    """torch's CUDA bytes by kind from a worker's /metrics text (`torch_allocated_bytes`...)."""
    found = {}
    for line in metrics.splitlines():
        if line.startswith("omnijev_cuda_memory_bytes{") and 'kind="' in line:
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            found[f"torch_{kind}_bytes"] = float(line.rsplit(" ", 1)[1])
    return found


def batches_command(m: Machine, args) -> dict:
    from bench.batches import batches, requests_table, table

    build(m, args)
    executor = executor_for(m, m.engines())
    built = executor.build_shapes()  # as the worker before ready
    executor.answer(json.dumps(executor.warm_up_request()).encode())
    record = {"environment": environment(), "built_before_ready": built}
    record["check_batches"] = executor.check_batches()
    record.update(batches(executor, args.seed, args.requests))
    m.save("batches.json", record)
    print(f"the batch check before ready: merges {record['check_batches']}")
    print(requests_table(record))
    print(table(record))
    return record


def sizes_command(m: Machine, args) -> dict:
    from bench.sizes import sizes, table

    build(m, args)
    executor = executor_for(m, m.engines())
    built = executor.build_shapes()  # the worker's warm-up: every shape, then its requests
    for body in warm_bodies(m):
        executor.answer(body)
    record = {"environment": environment(), "built_before_ready": built}
    record["warm_builds"] = executor.shape_builds()
    record.update(sizes(executor, args.seed, args.questions))
    m.save(f"sizes{questions_suffix(args)}.json", record)
    print(table(record))
    return record


def plans_command(m: Machine, args) -> dict:
    from bench.plans import plans, table

    build(m, args)
    executor = executor_for(m, m.engines())
    if args.times:
        return replanned_sizes(m, executor, args)
    record = {
        "environment": environment(),
        **plans(executor, args.seed, args.requests, args.questions),
    }
    m.save(f"plans{questions_suffix(args)}.json", record)
    print(table(record))
    return record


def replanned_sizes(m: Machine, executor, args) -> dict:
    """`plans --times RECORD`: a `sizes` record's requests planned here beside its times, and
    the warm times fitted on the plans' passes and token slots."""
    from bench.sizes import replanned, table

    measured = args.sizes_record
    try:
        record = replanned(executor, measured, args.seed, args.questions)
    except ValueError as error:
        raise SystemExit(f"plans --times: {error}") from None
    record["times"] = {"path": str(args.times), "environment": measured.get("environment")}
    record["environment"] = environment()
    m.save(f"plans-{args.times.stem}.json", record)
    print(table(record))
    return record


def run_name(args) -> str:
    """A serve run's name in its records: the suite, and the questions where they are fixed."""
    return args.suite + questions_suffix(args)


def questions_suffix(args) -> str:
    """A record's name ends in the questions a request where they are fixed."""
    return f"-q{args.questions}" if args.questions else ""


# -- command line ------------------------------------------------------------------------------


def common(m: Machine) -> list[str]:
    """The options that make another process of this module work on the same machine."""
    return [*(["--tiny"] if m.preset == "tiny" else []), "--work", str(m.work), "--out", str(m.out)]


COMMANDS = {
    "build": build,
    "latency": latency_command,
    "parity": parity_command,
    "cold": cold_command,
    "serve": serve_command,
    "batches": batches_command,
    "sizes": sizes_command,
    "plans": plans_command,
    "reference-answers": reference_answers,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--tiny", action="store_true", help="the tiny preset, float32, CPU")
    parser.add_argument("--work", type=Path, default=WORK, help="checkpoints and engines")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", OUT)))
    parser.add_argument("--runs", type=int, default=RUNS, help="latency: warm runs a workload")
    parser.add_argument("--reference", action="store_true", help="latency: the reference too")
    parser.add_argument(
        "--workload", action="append", default=None, help="latency: this workload only"
    )
    parser.add_argument("--suite", choices=("traffic", "bench"), default="traffic")
    parser.add_argument("--clients", default="1,16", help="serve: client counts, in turn")
    parser.add_argument(
        "--requests",
        type=int,
        default=load.REQUESTS,
        help="serve: a run's; batches, plans: suite requests",
    )
    parser.add_argument("--warm-up", type=int, default=0, help="serve: requests not counted")
    parser.add_argument(
        "--questions", type=int, default=None, help="serve, sizes, plans: questions each"
    )
    parser.add_argument("--seed", type=int, default=0, help="serve: the traffic suite's")
    parser.add_argument(
        "--times", type=Path, default=None, help="plans: a sizes record's requests, planned"
    )
    parser.add_argument("--answers", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes_record = None
    if args.times is not None:
        from bench.sizes import read_record

        try:
            args.sizes_record = read_record(args.times)
        except ValueError as error:
            parser.error(f"--times: {error}")
    unknown = sorted(set(args.workload or ()) - set(workloads()))
    if unknown:
        parser.error(f"unknown workload {unknown[0]!r}; one of {sorted(workloads())}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        m = Machine("tiny", "cpu", "float32", args.work, args.out)
    else:
        m = Machine("4b", "cuda", "bfloat16", args.work, args.out)
    m.work.mkdir(parents=True, exist_ok=True)
    record = COMMANDS[args.command](m, args)
    return 1 if isinstance(record, dict) and record.get("load_exit") else 0


if __name__ == "__main__":
    sys.exit(main())
