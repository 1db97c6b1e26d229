"""Reads that feel like torch: ``tolist()``, ``numpy()``, ``np.asarray``, ``bool``/``int``/
``float``/``complex``, ``__index__``, ``item()``, ``format`` and ``len`` of a DTensor give what
torch gives for the full tensor (or raise torch's error), on every runner, for Replicate, Shard
(uneven: 7 or 10 rows on 4 ranks) and Partial inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtorch_core as dt

from .helpers import bad_index_raises, distribute_spread, on_mesh

R, P = dt.Replicate(), dt.Partial("sum")
S0, S1 = dt.Shard(0), dt.Shard(1)
SPECS = [(R, R), (S0, R), (S0, S1), (P, S0), (R, P)]


def _both(mesh, t, spec):
    return distribute_spread(t, mesh, on_mesh(mesh, spec)), t


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("shape,dtype", [((7, 3), torch.float32), ((10,), torch.int64), ((2, 5), torch.float64)],
                         ids=str)
def test_tolist_and_numpy(mesh, spec, shape, dtype):
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 10).to(dtype)
    if dtype == torch.int64 and P in spec:
        spec = tuple(S0 if p == P else p for p in spec)  # an integer Partial has no random split
    spec = tuple(R if isinstance(p, dt.Shard) and p.dim >= len(shape) else p for p in spec)
    x, ref = _both(mesh, t, spec)
    out = x.tolist()
    expected = ref.tolist()
    if dtype.is_floating_point:
        np.testing.assert_allclose(np.array(out), np.array(expected), rtol=1e-6, atol=1e-5)
    else:
        assert out == expected
    arr = x.numpy()
    assert isinstance(arr, np.ndarray) and arr.dtype == ref.numpy().dtype and arr.shape == ref.shape
    np.testing.assert_allclose(arr, ref.numpy(), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(x), ref.numpy(), rtol=1e-6, atol=1e-5)
    assert np.asarray(x, dtype=np.float64).dtype == np.float64


def test_tolist_of_a_0d_tensor_is_a_number(mesh):
    x = dt.distribute_tensor(torch.tensor(2.5), mesh, [R] * mesh.ndim)
    assert x.tolist() == 2.5 and torch.tensor(2.5).tolist() == 2.5
    p = distribute_spread(torch.tensor(4.0), mesh, [P] * mesh.ndim)
    assert abs(p.tolist() - 4.0) < 1e-5


def test_empty_shards_and_empty_tensors(mesh):
    t = torch.arange(3.0)  # 3 rows on 4 ranks: the last shard is empty
    x = dt.distribute_tensor(t, mesh, on_mesh(mesh, (S0, R)))
    assert x.tolist() == t.tolist()
    e = dt.distribute_tensor(torch.empty(0, 4), mesh, on_mesh(mesh, (S0, S1)))
    assert e.tolist() == [] and e.numpy().shape == (0, 4)


def test_numpy_refuses_requires_grad_like_torch(mesh):
    t = torch.randn(5, 2)
    x = dt.distribute_tensor(t, mesh, on_mesh(mesh, (S0, R))).requires_grad_(True)
    with pytest.raises(RuntimeError) as theirs:
        t.clone().requires_grad_(True).numpy()
    with pytest.raises(RuntimeError) as ours:
        x.numpy()
    assert str(ours.value) == str(theirs.value)
    np.testing.assert_allclose(x.numpy(force=True), t.numpy())
    np.testing.assert_allclose(x.detach().numpy(), t.numpy())
    assert x.tolist() == t.tolist()  # tolist reads through autograd, as torch's does
    assert x.grad is None


@pytest.mark.parametrize("spec", [(R, R), (S0, R), (P, R), (R, P)], ids=str)
@pytest.mark.parametrize("value", [0.0, -3.25, 7.0])
def test_python_number_conversions(mesh, spec, value):
    ref = torch.tensor([value])
    x, _ = _both(mesh, ref, spec)
    assert abs(float(x) - float(ref)) < 1e-5
    assert abs(x.item() - ref.item()) < 1e-5
    assert abs(complex(x) - complex(ref)) < 1e-5
    assert bool(x) == bool(ref) or value == 0.0  # a spread Partial zero may round to 1e-8
    i = dt.distribute_tensor(ref.to(torch.int64), mesh, [R] * mesh.ndim)
    assert int(i) == int(ref) and bool(i) == bool(ref)
    assert [10, 20, 30, 40, 50, 60, 70, 80][dt.distribute_tensor(torch.tensor(3), mesh, [R] * mesh.ndim)] == 40
    assert operator_index(dt.distribute_tensor(torch.tensor([5]), mesh, on_mesh(mesh, (S0, R)))) == 5


def operator_index(x):
    import operator

    return operator.index(x)


@pytest.mark.parametrize("call", ["bool", "item", "int", "float", "index"])
def test_conversion_errors_are_torchs(mesh, call):
    t = torch.arange(6.0)
    x = dt.distribute_tensor(t, mesh, on_mesh(mesh, (S0, R)))
    fns = {"bool": bool, "item": lambda v: v.item(), "int": int, "float": float,
           "index": lambda v: [1, 2][v]}
    with pytest.raises(Exception) as theirs:
        fns[call](t)
    with pytest.raises(type(theirs.value)) as ours:
        fns[call](x)
    assert str(ours.value) == str(theirs.value)


def test_index_of_a_float_tensor_raises_like_torch(mesh):
    t = torch.tensor(1.0)
    x = dt.distribute_tensor(t, mesh, [R] * mesh.ndim)
    with pytest.raises(TypeError) as theirs:
        [1, 2][t]
    with pytest.raises(TypeError) as ours:
        [1, 2][x]
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("fmt", ["", ".3f", "+.2e", ">12.1f"])
def test_format_of_0d_reads_the_value(mesh, fmt):
    ref = torch.tensor(3.14159)
    x = distribute_spread(ref, mesh, [P] * mesh.ndim)
    ours, theirs = format(x, fmt), format(ref, fmt)
    if fmt:
        assert ours == theirs
    else:
        assert abs(float(ours) - float(theirs)) < 1e-5


def test_format_of_nd_is_torchs(mesh):
    t = torch.arange(6.0)
    x = dt.distribute_tensor(t, mesh, on_mesh(mesh, (S0, R)))
    assert format(x) == str(x) == repr(x)  # metadata only: no read for a tensor of many values
    with pytest.raises(TypeError, match="unsupported format string"):
        format(t, ".2f")
    with pytest.raises(TypeError, match="unsupported format string"):
        format(x, ".2f")


def test_len_and_iteration(mesh):
    t = torch.arange(14.0).reshape(7, 2)
    x = dt.distribute_tensor(t, mesh, on_mesh(mesh, (S0, S1)))
    assert len(x) == len(t) == 7
    assert [row.tolist() for row in x] == [row.tolist() for row in t]
    s = dt.distribute_tensor(torch.tensor(1.0), mesh, [R] * mesh.ndim)
    with pytest.raises(TypeError) as theirs:
        len(torch.tensor(1.0))
    with pytest.raises(TypeError) as ours:
        len(s)
    assert str(ours.value) == str(theirs.value)


@bad_index_raises
def test_a_read_raises_a_failed_ops_worker_error(mesh):
    x = dt.distribute_tensor(torch.arange(8), mesh, [R] * mesh.ndim)
    bad = torch.ops.aten.index_select.default(x, 0, dt.distribute_tensor(torch.tensor([99]), mesh,
                                                                         [R] * mesh.ndim))
    with pytest.raises(dt.WorkerError):
        bad.tolist()
    assert x.tolist() == list(range(8))  # the session is still usable
