"""The fused kernel (probe.capture.fused): a block's softmax and its rows' statistics in one
pass, against the same quantities computed in float64 with torch; the same numbers whatever the
threads; and the torch path where no compiler builds it."""

import subprocess
import sys

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
    """In a fresh process, with a compiler that fails and with one that does not run: no
    kernel, the reason in ``described``, the row path's blocks from torch's softmax, and
    nothing left in the cache folder."""
    code = (
        "import os, torch\n"
        "from probe.capture import fused\n"
        "from probe.capture.rows import Scored\n"
        "q = torch.randn(1, 2, 6, 4)\n"
        "for compiler in ('/bin/false', '/nonexistent/cc'):\n"
        "    os.environ['CC'] = compiler\n"
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
    failed, missing = out.stdout.splitlines()
    assert failed.startswith("torch (/bin/false failed on fused.c")
    assert missing.startswith("torch (the C compiler /nonexistent/cc does not run")
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
