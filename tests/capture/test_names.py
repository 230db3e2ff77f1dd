"""Hook names are built and parsed in ``probe.capture.names`` only, and the model facts derived in
``probe.capture.architectures`` only: a scan of the library and the analyses keeps it so. Also:
patching
per head works on a rotary model's rotated queries and keys."""

import ast
import re
from pathlib import Path

import pytest
import torch
from models import small_model

import probe

ROOT = Path(__file__).resolve().parents[2]
NAMES = ROOT / "probe" / "capture" / "names.py"
ARCHITECTURES = ROOT / "probe" / "capture" / "architectures.py"
SPEC = ROOT / "probe" / "capture" / "spec.py"  # the model's description: derived from them

# A hook name written out: "attn.hook_pattern", "blocks.0.attn.hook_z", ".hook_z".
_LITERAL = re.compile(r"\.?(?:\w+\.)+hook_\w+")
# An f-string's text with "{}" for its fields, building a hook name: f"blocks.{l}.attn.hook_z",
# f".{attn}.hook_z", f"{stack}.{layer}.attn".
_TEMPLATE = re.compile(
    r"(?:^|[.}])(?:attn|cross_attn|hook_\w+)(?:$|[.{])|(?:^|\W)(?:blocks|encoder|decoder)\.\{"
)
_PARTS = {"blocks", "encoder", "decoder", "attn", "cross_attn"}
# Splitting or joining on dots (hook names: probe.capture.names.parse and point_of).
_DOTTED = {"split", "rsplit", "partition", "rpartition", "replace", "count"}
# Model facts: probe.capture.architectures.is_encoder_decoder, is_causal, head_dim.
_FACTS = {"is_encoder_decoder", "is_decoder", "num_attention_heads"}


def by_hand(source: str, facts: bool = True) -> list[tuple[int, str]]:
    """Where ``source`` builds, splits or parses a hook name by hand (or, with ``facts``,
    reads a model fact off the config): (line, what)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            if _TEMPLATE.search(text):
                found.append((node.lineno, f"f-string {text!r}"))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings | in_fstrings
        ):
            text = node.value
            if _LITERAL.fullmatch(text) or (text.strip(".") in _PARTS and text != text.strip(".")):
                found.append((node.lineno, f"string {text!r}"))
            if facts and text in _FACTS:
                found.append((node.lineno, f"model fact {text!r}"))
        elif isinstance(node, ast.Attribute) and facts and node.attr in _FACTS:
            found.append((node.lineno, f"model fact .{node.attr}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            method = node.func.attr
            if method in _DOTTED and args[:1] == ["."]:
                found.append((node.lineno, f".{method}('.')"))
            if method in {"startswith", "endswith"} and any(
                isinstance(a, str) and (a.strip(".") in _PARTS or a.strip(".").startswith("hook_"))
                for a in args
            ):
                found.append((node.lineno, f".{method}({args[0]!r})"))
    return found


def test_no_hook_name_is_built_by_hand():
    """Outside probe/capture/names.py, no module of probe or analyses formats, splits or parses a
    hook name itself, and outside probe/capture/architectures.py (and the description derived from
    it, probe/capture/spec.py) none reads is_encoder_decoder, is_decoder or num_attention_heads
    off a config."""
    files = sorted([*(ROOT / "probe").rglob("*.py"), *(ROOT / "analyses").rglob("*.py")])
    assert len(files) > 20
    problems = []
    for path in files:
        if path == NAMES:
            continue
        found = by_hand(path.read_text(), facts=path not in (ARCHITECTURES, SPEC))
        name = path.relative_to(ROOT).as_posix()
        if found:
            problems += [f"{name}:{line}: {what}" for line, what in found]
    assert not problems, (
        "use probe.capture.names (hook names) and probe.capture.architectures (model facts):\n"
        + ("\n".join(problems))
    )


@pytest.mark.parametrize(
    "line",
    [
        'names = [f"blocks.{l}.attn.hook_z" for l in range(n)]',
        "name = f\"{site.replace('.', f'.{layer}.')}.{suffix}\"",
        'names = [n for n in points if f".{attn}.hook_z" in n]',
        'pattern = cache["attn.hook_pattern"]',
        'stack, attn = attention.split(".")',
        'point = name.rsplit(".", 1)[-1]',
        'decoder = (attention or "").startswith("decoder")',
        'cross = attention.endswith("cross_attn")',
        'prefix = "blocks." + str(layer) + ".attn.hook_z"',
        'pair = getattr(model.config, "is_encoder_decoder", False)',
        "n_heads = model.config.num_attention_heads",
    ],
)
def test_the_scan_finds_names_built_by_hand(line):
    assert by_hand(line)


def test_the_scan_lets_names_through_probe_names():
    source = '''
"""A docstring may show ``cache["blocks.0.attn.hook_pattern"]``."""
from probe.capture.names import hook_name, parse, point_of

def f(model, layer, names):
    """And ``blocks.{l}.attn.hook_z``."""
    name = hook_name("hook_z", layer, "decoder.cross_attn")
    points = [n for n in names if point_of(n) == "hook_pattern"]
    raise ValueError(f"no hook_pattern in layer {layer}; trace the model with 'hook_pattern'")
'''
    assert by_hand(source) == []


@pytest.mark.parametrize("hook", ["hook_rot_q", "hook_rot_k"])
def test_patching_rotated_queries_and_keys_per_head(hook):
    """On a rotary model (Llama: 4 query heads, 2 key/value heads), the rotated queries and keys
    patch per head and position: one row per layer, head (key/value head for keys) and
    position. Where the answer is known, patching changes nothing: in layer 0 at the last
    position, which holds the same token in both inputs (same rotated query and key); a query at
    position 0, which sees only itself; a query of the last layer at another position than the
    last, the one the metric reads. Everywhere else it changes the metric."""
    model = small_model("llama")
    with torch.no_grad():  # sharper patterns than random initialisation's near-uniform ones
        for block in model.layers:
            block.self_attn.q_proj.weight.mul_(10)
    clean = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    corrupted = {"input_ids": torch.tensor([[9, 10, 11, 8]])}
    w = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    metric = lambda out: out.last_hidden_state[0, -1] @ w  # noqa: E731
    table = probe.patch(model, clean, corrupted, metric, hook=hook, per_position=True)
    heads = 4 if hook == "hook_rot_q" else 2
    assert len(table) == 2 * heads * 4
    assert sorted(set(table["head"])) == list(range(heads))
    assert sorted(set(table.position)) == [0, 1, 2, 3]
    assert abs(table.attrs["clean"] - table.attrs["corrupted"]) > 1e-3
    nothing = (table.layer == 0) & (table.position == 3)
    if hook == "hook_rot_q":
        # The last layer's queries reach the metric (the last position) only from there.
        nothing |= (table.position == 0) | ((table.layer == 1) & (table.position < 3))
    assert nothing.sum() == (heads if hook == "hook_rot_k" else heads * 5)
    assert (table[nothing].recovered.abs() < 1e-6).all()
    assert (table[~nothing].recovered.abs() > 1e-4).all()


def test_patching_a_rotated_point_of_a_model_without_rotation_is_a_clear_error():
    model = small_model("bert")
    batch = {"input_ids": torch.tensor([[5, 6, 7]])}
    with pytest.raises(probe.ProbeError, match="only rotary models"):
        probe.patch(model, batch, batch, lambda out: out.last_hidden_state.sum(), hook="hook_rot_q")


def test_act_name_takes_every_norm_a_block_has():
    from probe.capture.names import act_name

    assert act_name("scale", 2, "ln1") == "blocks.2.ln1.hook_scale"
    assert act_name("normalized", 0, "ln3") == "blocks.0.ln3.hook_normalized"
    assert act_name("scale", 1, "ln1_post") == "blocks.1.ln1_post.hook_scale"
    assert act_name("scale") == "ln_final.hook_scale"
    with pytest.raises(ValueError, match="say which norm"):
        act_name("scale", 0, "ln9")
