"""Export and import of one sequence's decode state (replayssm_jax.sequence_state): a sequence moved
mid-buffer into another cache's row, or through a safetensors file, continues with the same greedy
tokens and logits bit for bit; bad imports are refused before anything changes."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import load_model
from models.common import make_commit, make_decode_step, make_prefill, make_verify_step, split_params
from replayssm_jax.sequence_state import (SequenceState, SequenceStateError, export_sequence, import_sequence,
                                          load_sequence, save_sequence)

DATA = Path(__file__).parent / "data"
L = 4


@pytest.fixture(scope="module", params=["nemotron_h_tiny", "qwen3_5_tiny"])
def fixture(request):
    """(name, graphdef, params, prefill, decode) of a fixture with ReplaySSM, L = 4, room for a window of 3."""
    graphdef, params = split_params(load_model(DATA / request.param))
    kw = dict(backend="xla")
    prefill = make_prefill(graphdef, max_len=32, replay_buffer_len=L, last_logits_only=True, max_window=3, **kw)
    return request.param, graphdef, params, prefill, make_decode_step(graphdef, **kw)


def _greedy(decode, params, cache, logits, steps):
    """`steps` greedy tokens from (logits, cache), and the last logits."""
    tokens = []
    for _ in range(steps):
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        tokens.append(np.asarray(token))
        logits, cache = decode(params, cache, token)
    return np.stack(tokens, 1), logits, cache


def test_a_sequence_moved_mid_buffer_continues_bit_for_bit(fixture, tmp_path):
    """Row 1 of a batch, exported after a prefill and 2 decode steps (its buffers part full), imported
    into row 0 of another batch's cache (other prompts, other lengths) directly and through a file:
    the next 6 greedy tokens (over a flush) and the logits equal the original row's exactly."""
    name, _, params, prefill, decode = fixture
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(3, 200, size=(2, 7)), jnp.int32)
    logits, cache = prefill(params, prompts)
    _, logits, cache = _greedy(decode, params, cache, logits, 2)
    state = export_sequence(cache, 1, model=name)
    assert len(state.arrays) == len(jax.tree.leaves(cache)) and state.nbytes > 0
    want, want_logits, _ = _greedy(decode, params, cache, logits, 6)

    other_logits, other = prefill(params, jnp.asarray(rng.integers(3, 200, size=(2, 7)), jnp.int32))
    path = tmp_path / "row.safetensors"
    save_sequence(path, state)
    for restored in (state, load_sequence(path)):
        moved = import_sequence(other, 0, restored, model=name)
        first = logits[1:2].repeat(2, 0)  # the row's next-token logits, as the decode loop holds them
        got, got_logits, _ = _greedy(decode, params, moved, first.at[1].set(other_logits[1]), 6)
        np.testing.assert_array_equal(got[0], want[1])
        np.testing.assert_array_equal(np.asarray(got_logits[0]), np.asarray(want_logits[1]))
    loaded = load_sequence(path)
    assert loaded.model == name and loaded.structure == state.structure
    for key, a in state.arrays.items():
        got = loaded.arrays[key]
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes()


# The refusals read the structure, shapes and dtypes, whatever the layers: Nemotron-H's by default, Qwen3.5's
# `slow`.
@pytest.mark.parametrize("fixture", ["nemotron_h_tiny", pytest.param("qwen3_5_tiny", marks=pytest.mark.slow)],
                         indirect=True)
def test_bad_imports_are_refused_and_the_cache_is_untouched(fixture, tmp_path):
    name, graphdef, params, prefill, decode = fixture
    prompts = jnp.asarray(np.random.default_rng(1).integers(3, 200, size=(2, 5)), jnp.int32)
    logits, cache = prefill(params, prompts)
    state = export_sequence(cache, 0, model=name)
    before = jax.tree.map(np.asarray, cache)
    with pytest.raises(SequenceStateError, match=r"`row` must be in \[0, 2\) \(the cache's batch\); got 2"):
        import_sequence(cache, 2, state)
    with pytest.raises(TypeError, match="`row` must be an int; got float"):
        export_sequence(cache, 1.0)
    with pytest.raises(SequenceStateError, match="`state` belongs to model .*; expected 'other'"):
        import_sequence(cache, 0, state, model="other")
    # a checkpoint folder given as a path is the model's name as its str, through a file too
    folder = DATA / name
    by_path = export_sequence(cache, 0, model=folder)
    assert by_path.model == str(folder)
    save_sequence(tmp_path / "by_path.safetensors", by_path)
    assert load_sequence(tmp_path / "by_path.safetensors").model == str(folder)
    import_sequence(cache, 0, by_path, model=str(folder))
    import_sequence(cache, 0, by_path, model=folder)
    with pytest.raises(TypeError, match=r"export_sequence: `model` must be a str, a path or None; got int 3"):
        export_sequence(cache, 0, model=3)
    with pytest.raises(TypeError, match=r"import_sequence: `model` must be a str, a path or None; got list"):
        import_sequence(cache, 0, state, model=["m"])

    def other_cache(**kw):  # shapes and dtypes only: the refusals read no values
        return jax.eval_shape(make_prefill(graphdef, max_len=32, last_logits_only=True, max_window=3, backend="xla",
                                           **kw), params, prompts)[1]

    standard = other_cache()
    with pytest.raises(SequenceStateError, match=r"another cache structure .*checkpoint format.*; they first differ "
                                                 r"at character \d+:\n  state: .{1,150}\n  cache: .{1,150}$") as e:
        import_sequence(standard, 0, state)
    assert len(str(e.value)) < 500  # a window around the difference, not the whole structures
    longer = other_cache(replay_buffer_len=2 * L)
    with pytest.raises(SequenceStateError, match=r"`state` array .* has shape .*; the cache's rows are"):
        import_sequence(longer, 0, state)
    narrow = other_cache(replay_buffer_len=L, buffer_dtype=jnp.bfloat16)
    with pytest.raises(SequenceStateError, match=r"`state` array .*replay\.[xBdk] has dtype float32; the cache's is "
                                                 r"bfloat16 \(a ReplaySSM record: its dtype is the `buffer_dtype`"):
        import_sequence(narrow, 0, state)
    window = make_verify_step(graphdef, backend="xla", donate_cache=False)(params, cache, jnp.ones((2, 3), jnp.int32))[1]
    with pytest.raises(SequenceStateError, match=r"export_sequence: the cache has a pending verify window \(W = 3\)"):
        export_sequence(window, 0)
    with pytest.raises(SequenceStateError, match="import_sequence: the cache has a pending verify window"):
        import_sequence(window, 0, state)
    committed = make_commit(donate_cache=False)(window, jnp.asarray([2, 0], jnp.int32))
    assert export_sequence(committed, 0).structure == state.structure
    bad = tmp_path / "weights.safetensors"
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32)}, str(bad))
    with pytest.raises(SequenceStateError, match="not a sequence state file"):
        load_sequence(bad)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not safetensors")
    with pytest.raises(SequenceStateError, match=r"garbage.safetensors: not a sequence state file \(not a safetensors"):
        load_sequence(garbage)
    with pytest.raises(TypeError, match="`state` must be a SequenceState; got dict"):
        import_sequence(cache, 0, {})
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache), before)
    assert isinstance(state, SequenceState)


def test_the_file_keeps_every_dtype_bit_for_bit(tmp_path):
    """bfloat16, float8_e4m3fn and int8 arrays (8-bit checkpoints, their scales, bf16 buffers), and a
    scalar, through save_sequence / load_sequence: the same bytes, dtypes and shapes."""
    rng = np.random.default_rng(2)
    values = rng.standard_normal((3, 5)).astype(np.float32)
    arrays = {".a": jnp.asarray(values, jnp.bfloat16), ".b": jnp.asarray(values, jnp.float8_e4m3fn),
              ".c": rng.integers(-127, 128, (4,)).astype(np.int8), ".d": np.asarray(7, np.int32)}
    state = SequenceState({k: np.asarray(v) for k, v in arrays.items()}, "structure", None)
    save_sequence(tmp_path / "s.safetensors", state)
    loaded = load_sequence(tmp_path / "s.safetensors")
    assert loaded.model is None and loaded.structure == "structure"
    for key, a in state.arrays.items():
        got = loaded.arrays[key]
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes()
    with pytest.raises(FileNotFoundError, match="no sequence state file"):
        load_sequence(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match=r"save_sequence: the folder of `path` .*no/such/s.safetensors"):
        save_sequence(tmp_path / "no" / "such" / "s.safetensors", state)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(("metadata", "match"), [
    (dict(structure="s", model="null"), "its metadata lacks dtypes"),
    (dict(structure="s", model="null", dtypes="{not json"), r"damaged sequence state file \(JSONDecodeError"),
    (dict(structure="s", model="null", dtypes='{".a": "float64"}'), r"damaged sequence state file \(ValueError"),
    (dict(structure="s", model="null", dtypes='{".a": "no-such-dtype"}'), r"damaged sequence state file \(TypeError"),
    (dict(structure="s", model="null", dtypes='{".b": "float32"}'), "name different arrays"),
], ids=["no-dtypes", "bad-json", "bytes-and-dtype", "unknown-dtype", "other-names"])
def test_a_damaged_file_raises_a_sequence_state_error(tmp_path, metadata, match):
    """A file of the sequence state format whose metadata is missing or disagrees with its arrays (three f32
    values, stored as u4): SequenceStateError naming the file."""
    from safetensors.numpy import save_file

    from replayssm_jax.sequence_state import FORMAT

    path = tmp_path / "damaged.safetensors"
    save_file({".a": np.ones(3, np.float32).view("u4")}, str(path), metadata={"format": FORMAT, **metadata})
    with pytest.raises(SequenceStateError, match=f"damaged.safetensors: .*{match}"):
        load_sequence(path)
