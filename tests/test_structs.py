"""shardflow.structs: the first decodes of a Struct type from several threads at once do not crash the process
(msgspec 0.22.0 segfaults there unless the type was prepared), and every typed decode in shardflow prepares its
type."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardflow"

# Modules of fresh Struct types (annotations as strings, as in shardflow's), each type decoded first by 4 threads at
# once.
MODULE = """
from __future__ import annotations
from typing import Annotated
import msgspec
Count = Annotated[int, msgspec.Meta(ge=0)]
class Part(msgspec.Struct, frozen=True):
    a: Count = 0
    b: list[Count] = []
class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    x: Count
    y: str | None = None
    z: list[Part] = []
    w: dict[str, Count] = {}
"""
PROGRAM = """
import importlib, os, sys, threading
import msgspec
from shardflow.structs import prepared

count, folder = int(sys.argv[1]), sys.argv[2]
sys.path.insert(0, folder)
for i in range(count):
    cls = importlib.import_module(f"fresh_{i}").Message
    barrier = threading.Barrier(4)
    def decode():
        barrier.wait()
        msgspec.convert({"x": 1, "z": [{"a": 2}]}, prepared(cls), strict=True)
    threads = [threading.Thread(target=decode) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
print("decoded")
"""


def test_threads_that_decode_a_struct_type_first_at_once_do_not_crash_the_process(tmp_path):
    count = 2500  # without prepared(): a segfault within the first 2000 types here, every run
    for i in range(count):
        (tmp_path / f"fresh_{i}.py").write_text(MODULE)
    command = [sys.executable, "-c", PROGRAM, str(count), str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "decoded", run.stderr[-3000:]


# A typed decode: msgspec.convert(obj, T), msgspec.json/msgpack.decode(data, type=T), a Decoder(T).
TYPED_DECODE = re.compile(r"msgspec\.(convert\(|(json|msgpack)\.(decode\(.*type=|Decoder\())")


def test_every_typed_decode_in_shardflow_prepares_its_type():
    found, bypassing = 0, []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "structs.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if TYPED_DECODE.search(line):
                found += 1
                if "prepared(" not in line:
                    bypassing.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert found >= 10, found  # the scan sees shardflow's decodes
    assert not bypassing, "decoded without shardflow.structs.prepared:\n" + "\n".join(bypassing)
