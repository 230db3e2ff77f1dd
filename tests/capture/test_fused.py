"""The fused kernel (probe.capture.fused): a block's softmax and its rows' statistics in one
pass, against the same quantities computed in float64 with torch; the same numbers whatever the
threads; and the torch path where no compiler builds it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from probe.capture import fused

LOWEST = torch.finfo(torch.float32).min


def scores(B, H, b, K, seed=0):
    """Scores as the row path makes them: random, a masked corner at the lowest float, a row
    whose every key is masked, tied maxima, a sharp row and a flat one."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, b, K, generator=g) * 4
    s.masked_fill_(torch.arange(K) > torch.arange(b)[:, None] + max(K - b, 0), LOWEST)  # causal
    if b > 1 and K > 2:
        s[0, 0, 1] = LOWEST  # every key masked: uniform, as torch's softmax makes it
        s[0, -1, 0, 1] = s[0, -1, 0, 2] = s[0, -1, 0].max() + 1  # a tie: the first key wins
        s[-1, 0, -1] = 0.0  # flat
        s[-1, -1, -1, 0] = 60.0  # sharp: entropy about 0, largest weight 1
    return s


def reference(s, weight):
    """Every statistic in float64, from torch's own softmax."""
    p = torch.softmax(s.double(), -1)
    entropy = -torch.where(p > 0, p * p.log(), torch.zeros(())).sum(-1)
    received = (weight.double()[:, None, None] @ p).squeeze(-2)
    return p, entropy, received


@pytest.mark.parametrize("shape", [(1, 4, 32, 1000), (2, 3, 5, 7), (1, 1, 1, 1), (3, 2, 9, 200)])
def test_the_kernel_equals_torch(shape):
    if fused.softmax_stats(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1)) is None:
        pytest.skip(f"the kernel is not built here: {fused.described()}")
    s = scores(*shape)
    B, _, b, K = shape
    weight = (torch.rand(B, b, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    pattern = torch.empty_like(s)
    stats = fused.softmax_stats(s.clone(), pattern, weight)
    p, entropy, received = reference(s, weight)
    torch.testing.assert_close(pattern.double(), p, atol=1e-7, rtol=1e-6)  # float32 sums
    torch.testing.assert_close(stats.entropy.double(), entropy, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(stats.received.double(), received, atol=2e-6, rtol=1e-6)
    # the largest weight and where it first lies, exactly as torch reads them from the pattern
    assert torch.equal(stats.top, pattern.amax(-1))
    assert torch.equal(stats.first, pattern.argmax(-1))
    assert (pattern[s == LOWEST] == 0).all() or (s == LOWEST).all(-1).any()
    if b > 1 and K > 2:
        assert stats.first[0, -1, 0] == 1  # the first of two tied maxima
        torch.testing.assert_close(pattern[0, 0, 1], torch.full((K,), 1 / K))
        assert stats.top[-1, -1, -1] == 1 and stats.entropy[-1, -1, -1].abs() < 1e-6
    # without weights, no sums of what the keys receive
    assert fused.softmax_stats(s.clone(), torch.empty_like(s)).received is None


def test_the_same_numbers_whatever_the_threads():
    """Each (batch, head) pair is one thread's, so the numbers are bit for bit the same."""
    s = scores(2, 4, 40, 3000)
    weight = torch.ones(2, 40)
    answers = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            pattern = torch.empty_like(s)
            stats = fused.softmax_stats(s.clone(), pattern, weight)
            if stats is None:
                pytest.skip(f"the kernel is not built here: {fused.described()}")
            answers.append((pattern, *stats))
    finally:
        torch.set_num_threads(before)
    for other in answers[1:]:
        assert all(torch.equal(a, b) for a, b in zip(answers[0], other, strict=True))


def test_a_cpu_float32_block_only():
    s = scores(1, 2, 3, 5)
    assert fused.softmax_stats(s.double(), torch.empty_like(s.double())) is None
    assert fused.softmax_stats(s.transpose(-1, -2), torch.empty(1, 2, 5, 3)) is None
    if fused.available(torch.device("cpu")):  # weights the kernel would read past
        with pytest.raises(ValueError, match=r"queries must be \[batch, rows\] = \[1, 3\]"):
            fused.softmax_stats(s, torch.empty_like(s), torch.ones(1, 2))


@pytest.mark.slow
def test_without_a_compiler_the_row_path_uses_torch(tmp_path):
    """In a fresh process, with a compiler that fails, one that does not exist, and no compiler
    on PATH: no kernel, the reason in ``described``, the row path's blocks from torch's softmax,
    and nothing left in the cache folder."""
    code = (
        "import os, torch\n"
        "from probe.capture import fused\n"
        "from probe.capture.rows import Scored\n"
        "q = torch.randn(1, 2, 6, 4)\n"
        "for compiler in ('/bin/false', '/nonexistent/cc', ''):\n"
        "    os.environ['CC'] = compiler\n"
        "    os.environ['PATH'] = '/usr/bin:/bin' if compiler else '/nonexistent'\n"
        "    fused._library.cache_clear()\n"
        "    block = Scored(q, q, None, True, 0.5).block(slice(0, 6))\n"
        "    assert block.fused is None and block.scores is not None\n"
        "    assert fused.softmax_stats(q, torch.empty_like(q)) is None\n"
        "    assert not fused.available(q.device) and fused.used() is not None\n"
        "    print(fused.described())\n"
    )
    env = {"PROBE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    failed, missing, none = out.stdout.splitlines()
    assert failed == "torch (false failed on fused.c (exit status 1))"
    assert missing == "torch (no C compiler: CC='/nonexistent/cc' names no program on PATH)"
    assert none == "torch (no C compiler: neither cc nor gcc is on PATH; set CC to one)"
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_built_once_into_the_cache(tmp_path):
    """A second process loads the library the first one built."""
    code = "from probe.capture import fused; print(fused.described())"
    env = {"PROBE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if first.stdout.startswith("torch ("):
        pytest.skip(f"the kernel is not built here: {first.stdout}")
    built = list((tmp_path / "kernels").glob("fused-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert second.stdout == first.stdout and built[0].stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built[0].name]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork on this system")
def test_a_forked_child_has_threads_of_its_own():
    """A child forked after the kernel ran has none of its parent's threads: it makes its own
    rather than wait for them."""
    code = (
        "import os, torch\n"
        "from probe.capture import fused\n"
        "torch.set_num_threads(2)\n"
        "s = torch.randn(1, 2, 64, 2048)\n"
        "fused.softmax_stats(s, torch.empty_like(s))\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    fused.softmax_stats(s, torch.empty_like(s))\n"
        "    os._exit(0)\n"
        "assert os.waitpid(child, 0)[1] == 0\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# The kernel's build and cache against what a machine may hold: a compiler that writes garbage
# or hangs, a cached library cut short, garbage or built for another processor, a cache folder
# that cannot be written, and two processes building at once. In each the run computes the same
# numbers (with the kernel or torch), says which in ``described``, never crashes or hangs, and
# leaves no library that a later run would load and crash on.

DESCRIBE = "from probe.capture import fused; print(fused.described())"
# Runs the kernel on a block and compares it with torch's softmax: "same" or what differs.
SAME = (
    "import torch\n"
    "from probe.capture import fused\n"
    "s = torch.randn(2, 3, 40, 300, generator=torch.Generator().manual_seed(0)) * 4\n"
    "pattern = torch.empty_like(s)\n"
    "stats = fused.softmax_stats(s, pattern)\n"
    "same = stats is None or torch.allclose(pattern, torch.softmax(s, -1), atol=1e-6)\n"
    "print(fused.described(), 'same' if same else 'DIFFERENT', stats is not None, sep='|')\n"
)


def child(code: str, cache, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``cache`` as probe's cache folder."""
    environment = {"PROBE_CACHE": str(cache), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                   **env}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def kernels(cache) -> list:
    """Every file in the cache's kernel folder (temporary ones included)."""
    folder = cache / "kernels"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def needs_a_compiler():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")


def fake_compiler(tmp_path, body: str) -> str:
    """A shell script standing in for the compiler: answers --version, then runs ``body`` with
    the output file in $out."""
    script = tmp_path / "fakecc"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi\n'
        'out=""; prev=""\n'
        'for a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done\n' + body
    )
    script.chmod(0o755)
    return str(script)


@pytest.mark.slow
def test_a_compiler_that_writes_a_broken_library(tmp_path):
    """It says it succeeded, and wrote garbage, or a library that computes something else: the
    check (in a child process) refuses it, torch computes, and nothing is cached."""
    needs_a_compiler()
    garbage = fake_compiler(tmp_path, 'printf "\\177ELF garbage" > "$out"\n')
    wrong_c = tmp_path / "wrong.c"
    wrong_c.write_text(
        "#include <stdint.h>\n"
        "void block_stats(const float *s, float *p, int64_t from, int64_t to, int64_t heads,\n"
        "  int64_t rows, int64_t keys, const float *w, float *r, float *e, float *t,\n"
        "  int64_t *f) { for (int64_t i = from * rows * keys; i < to * rows * keys; i++)\n"
        "  p[i] = 0.5f; }\n"
    )
    wrong = fake_compiler(tmp_path / "..", f'exec cc -shared -fPIC -o "$out" {wrong_c}\n')
    for compiler, why in [(garbage, "OSError"), (wrong, "wrong numbers in row 0")]:
        cache = tmp_path / f"cache-{Path(compiler).parent.name}"
        done = child(SAME, cache, CC=compiler)
        described, same, ran = done.stdout.strip().split("|")
        assert described.startswith("torch (fakecc built a kernel that failed its check (")
        assert why in described and same == "same" and ran == "False"
        assert kernels(cache) == []


@pytest.mark.slow
def test_a_compiler_that_hangs_is_stopped(tmp_path, monkeypatch):
    """A compiler that never finishes, with a child of its own holding the pipes: stopped after
    ``BUILD_S``, whatever it started, and torch computes."""
    hangs = fake_compiler(tmp_path, "sleep 600 &\nwait\n")
    monkeypatch.setenv("CC", hangs)
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fused, "BUILD_S", 1.0)
    fused._library.cache_clear()
    try:
        assert not fused.available(torch.device("cpu"))
        assert fused.described() == "torch (fakecc failed on fused.c (no answer in 1 s; stopped))"
    finally:
        fused._library.cache_clear()
    assert kernels(tmp_path / "cache") == []


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_cached_kernel_is_rebuilt(tmp_path, damage):
    """A cached library cut short (which kills the process that loads it, with SIGBUS), garbage,
    or empty: its check fails in a child, it is rebuilt, the run says so, and the next run loads
    the rebuilt one without a word."""
    needs_a_compiler()
    first = child(SAME, tmp_path).stdout.strip().split("|")
    if first[0].startswith("torch ("):
        pytest.skip(f"the kernel is not built here: {first[0]}")
    (name,) = kernels(tmp_path)
    path = tmp_path / "kernels" / name
    whole = path.read_bytes()
    path.write_bytes({"truncated": whole[: len(whole) // 3], "garbage": b"\x7fELF" + bytes(999),
                      "empty": b""}[damage])  # fmt: skip
    described, same, ran = child(SAME, tmp_path).stdout.strip().split("|")
    assert described.startswith(f"{first[0]}; the cached kernel failed its check (")
    assert described.endswith("), rebuilt") and same == "same" and ran == "True"
    assert kernels(tmp_path) == [name] and path.read_bytes() == whole
    assert child(SAME, tmp_path).stdout.strip().split("|") == first


@pytest.mark.slow
def test_a_kernel_built_for_another_processor(tmp_path, monkeypatch):
    """The cache is keyed by the processor's model and flags: another processor builds its own.
    And a library whose instructions this processor lacks (here one that executes an illegal
    instruction) dies in the check's child process, never in the run's, and is rebuilt."""
    needs_a_compiler()
    first = child(DESCRIBE, tmp_path).stdout.strip()
    if first.startswith("torch ("):
        pytest.skip(f"the kernel is not built here: {first}")
    (name,) = kernels(tmp_path)
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.setattr(fused, "_processor", lambda: "flags\t\t: fpu sse sse2 (another one)\n")
    fused._library.cache_clear()
    try:
        assert fused.available(torch.device("cpu"))
        other = [n for n in kernels(tmp_path) if n != name]
        assert len(other) == 1 and fused.described() == first
    finally:
        fused._library.cache_clear()
    trap = tmp_path / "trap.c"
    trap.write_text(
        "#include <stdint.h>\n"
        "void block_stats(const float *s, float *p, int64_t from, int64_t to, int64_t heads,\n"
        "  int64_t rows, int64_t keys, const float *w, float *r, float *e, float *t,\n"
        "  int64_t *f) { __builtin_trap(); }\n"
    )
    path = tmp_path / "kernels" / name
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(path), str(trap)],
                   check=True)  # fmt: skip
    described, same, ran = child(SAME, tmp_path).stdout.strip().split("|")
    assert described == f"{first}; the cached kernel failed its check (killed by SIGILL), rebuilt"
    assert same == "same" and ran == "True"


@pytest.mark.slow
def test_a_cache_folder_that_cannot_be_written(tmp_path):
    """PROBE_CACHE under a file (as root, a folder's mode does not stop writes): the kernel is
    built in a temporary folder for this run alone, checked, loaded, and the folder removed."""
    needs_a_compiler()
    (tmp_path / "a-file").write_text("")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    done = child(SAME, tmp_path / "a-file" / "cache", TMPDIR=str(temporary))
    described, same, ran = done.stdout.strip().split("|")
    if described.startswith("torch (no C compiler"):
        pytest.skip(described)
    assert described.endswith(f"; built for this run alone: the cache folder "
                              f"{tmp_path}/a-file/cache/kernels cannot be written (Not a "
                              "directory)")  # fmt: skip
    assert same == "same" and ran == "True" and list(temporary.iterdir()) == []


@pytest.mark.slow
def test_two_processes_build_it_at_once(tmp_path):
    """Two first runs build at the same time, each into a temporary name: both load a checked
    kernel, one library is left, and no temporary file."""
    needs_a_compiler()
    environment = {"PROBE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", SAME], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=environment)
            for _ in range(2)]  # fmt: skip
    answers = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], answers
    lines = [out.strip().split("|") for out, _ in answers]
    if lines[0][0].startswith("torch ("):
        pytest.skip(f"the kernel is not built here: {lines[0][0]}")
    assert lines[0] == lines[1] and lines[0][1:] == ["same", "True"]
    assert len(kernels(tmp_path)) == 1 and kernels(tmp_path)[0].startswith("fused-")


@pytest.mark.slow
def test_a_run_without_a_working_kernel_writes_the_same_tables(tiny_model, tmp_path):
    """``probe analyze`` on a long corpus, with the kernel and with a compiler that writes
    garbage: the same tables to float32 rounding, and run.json says which path ran and why."""
    import json

    import pandas as pd

    needs_a_compiler()
    corpus = tmp_path / "notes.txt"
    corpus.write_text("the cat sat on the mat and the dog lay by the door\n" * 40)
    garbage = fake_compiler(tmp_path, 'printf "garbage" > "$out"\n')
    cards = {}
    for name, extra in [("kernel", {}), ("torch", {"CC": garbage})]:
        out = tmp_path / name
        command = [
            sys.executable,
            "-m",
            "probe.app.cli",
            "analyze",
            "-m",
            str(tiny_model),
            "-a",
            "roles",
            "--corpus",
            str(corpus),
            "--context",
            "4096",
            "-q",
            "-o",
            str(out),
        ]
        environment = {k: v for k, v in os.environ.items() if k != "CC"}
        environment |= {"PROBE_CACHE": str(tmp_path / f"cache-{name}"), **extra}
        done = subprocess.run(command, capture_output=True, text=True, env=environment,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr
        cards[name] = json.loads((out / "run.json").read_text())["row_statistics"]
    if cards["kernel"].startswith("torch ("):
        pytest.skip(f"the kernel is not built here: {cards['kernel']}")
    assert cards["kernel"].startswith("fused C kernel, ")
    assert cards["torch"].startswith("torch (fakecc built a kernel that failed its check (")
    tables = sorted(p.name for p in (tmp_path / "kernel").glob("*.csv"))
    assert tables == sorted(p.name for p in (tmp_path / "torch").glob("*.csv")) and tables
    for table in tables:
        a, b = (pd.read_csv(tmp_path / run / table) for run in ("kernel", "torch"))
        # the head map's coordinates place 8 random heads about 1e-3 apart: an
        # embedding that turns float32 rounding into visible moves; every measured column agrees
        mds = [c for c in a.columns if c.startswith("mds_")]
        pd.testing.assert_frame_equal(a.drop(columns=mds), b.drop(columns=mds), rtol=1e-5,
                                      atol=1e-6)  # fmt: skip


@pytest.mark.slow
def test_a_library_that_hangs_in_its_check_is_refused(tmp_path, monkeypatch):
    """A built library that never returns from its test block: its check is stopped after
    ``CHECK_S``, and torch computes; nothing is cached."""
    needs_a_compiler()
    loop = tmp_path / "loop.c"
    loop.write_text(
        "#include <stdint.h>\n"
        "void block_stats(const float *s, float *p, int64_t from, int64_t to, int64_t heads,\n"
        "  int64_t rows, int64_t keys, const float *w, float *r, float *e, float *t,\n"
        "  int64_t *f) { for (volatile int i = 0; ; i++) ; }\n"
    )
    compiler = fake_compiler(tmp_path, f'exec cc -shared -fPIC -o "$out" {loop}\n')
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fused, "CHECK_S", 2.0)
    fused._library.cache_clear()
    try:
        assert not fused.available(torch.device("cpu"))
        assert fused.described() == ("torch (fakecc built a kernel that failed its check (no "
                                     "answer in 2 s; stopped))")  # fmt: skip
    finally:
        fused._library.cache_clear()
    assert kernels(tmp_path / "cache") == []


@pytest.mark.slow
def test_what_a_killed_build_left_is_removed(tmp_path, monkeypatch):
    """A build killed midway leaves its temporary file (never loaded: it has no kernel's name);
    the next build removes it once it is older than any build could be, and leaves a fresh one
    (another process's build under way)."""
    needs_a_compiler()
    folder = tmp_path / "kernels"
    folder.mkdir()
    old, fresh = folder / ".probe-tmp-old.so", folder / ".probe-tmp-fresh.so"
    old.write_bytes(b"half a library")
    fresh.write_bytes(b"being written")
    os.utime(old, (0, 0))
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    fused._library.cache_clear()
    try:
        fused.available(torch.device("cpu"))
    finally:
        fused._library.cache_clear()
    assert not old.exists() and fresh.exists()


@pytest.mark.slow
def test_a_read_only_cache_folder(tmp_path, monkeypatch):
    """A cache folder the system refuses to write (a read-only mount: EROFS on every write,
    made here by the writer, as root writes through a folder's mode): a build for this run
    alone, checked and loaded, and run.json says why."""
    needs_a_compiler()
    from probe.files import WriteError

    def refused(path, content):
        raise WriteError(path, "Read-only file system")

    monkeypatch.setattr(fused, "write_file", refused)
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    fused._library.cache_clear()
    try:
        s = torch.randn(1, 2, 8, 100)
        pattern = torch.empty_like(s)
        assert fused.softmax_stats(s, pattern) is not None
        torch.testing.assert_close(pattern, torch.softmax(s, -1), atol=1e-6, rtol=1e-5)
        assert fused.described().endswith(f"; built for this run alone: the cache folder "
                                          f"{tmp_path}/kernels cannot be written (Read-only "
                                          "file system)")  # fmt: skip
    finally:
        fused._library.cache_clear()
    assert kernels(tmp_path) == []
