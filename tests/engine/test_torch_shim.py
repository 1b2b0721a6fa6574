"""Tensors' facts through torch's C shim (``gradaudit.engine.torch_shim``), against torch's
own binding: the same dtype, device, shape, contiguity and address for every kind of
tensor, a refusal wherever a list differs from its signature, and nothing bound where the
checks before binding fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gradaudit.engine import native, native_rows, torch_shim
from tests.engine.test_bulk import mixed

_module = native_rows.module()

#: torch 2.13 (the pinned version) holds a tensor's at::Tensor right after its Python
#: object's header, where the shim is bound; older ones may not (the floor leg's 2.4 holds a
#: MaybeOwned there), and then nothing is bound.
PINNED = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)

bound = pytest.mark.skipif(
    _module is None or not torch_shim.bound(),
    reason="torch's C shim is not bound with this torch or without the native extension",
)


class Sub(torch.Tensor):
    """A subclass: not a plain tensor, whatever its layout."""


@pytest.fixture
def rebind() -> Iterator[None]:
    """Bind again (checked) after a test that unbinds."""
    yield
    torch_shim.bound.cache_clear()
    torch_shim.bound()


def kinds() -> list[torch.Tensor]:
    """Tensors of every kind a list may hold: dtypes, ranks 0-7 (past the 5 sizes torch
    keeps inline), slices, transposes, expanded (stride 0) and empty ones."""
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(4, 6, 5, generator=generator)
    found = [
        base,
        base[1:3],
        base[:, 2:],
        base.transpose(0, 2),
        base[..., ::2],
        torch.randn(5, generator=generator).expand(3, 5),
        torch.randn(2, 1, 3, 1, 2, 1, 2, generator=generator),
        torch.randn(2, 1, 3, 1, 2, 1, 2, generator=generator).transpose(0, 6),
        torch.empty(0),
        torch.empty(3, 0, 2),
        torch.tensor(1.5),
        torch.nn.Parameter(torch.randn(3, 3, generator=generator)),
    ]
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool):
        found.append(torch.zeros(2, 9, dtype=dtype)[:, 1:])
        found.append(torch.zeros(7, dtype=dtype))
    found.append(torch.zeros(4, dtype=torch.float8_e4m3fn))
    found.append(torch.zeros(3, dtype=torch.complex64))
    return found


def test_the_shim_is_bound_with_the_pinned_torch() -> None:
    assert _module is not None, "the native extension is not built"
    assert torch_shim.bound() or not PINNED


@bound
def test_every_fact_is_torchs_own() -> None:
    assert _module is not None
    codes: dict[torch.dtype, int] = {}
    for tensor in kinds():
        dtype, device_type, device_index, layout, contiguous, sizes, address = _module.shim_facts(
            tensor
        )
        assert codes.setdefault(tensor.dtype, dtype) == dtype
        assert (device_index, contiguous, sizes, address) == (
            tensor.get_device(),
            tensor.is_contiguous(),
            tuple(tensor.shape),
            tensor.data_ptr(),
        ), tensor.shape
        assert device_type == 0  # c10::DeviceType::CPU
        assert layout == _module.shim_facts(torch.zeros(1))[3]
    assert len(set(codes.values())) == len(codes)  # one code per dtype


@bound
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_layout_without_strides_has_no_facts() -> None:
    assert _module is not None
    sparse = torch.zeros(3, 3)
    sparse[1, 2] = 1.0
    assert _module.shim_facts(sparse.to_sparse()) is None
    assert _module.shim_facts(sparse.to_sparse_csr()) is None
    assert torch_shim.signature([torch.zeros(2), sparse.to_sparse()]) is None


@bound
def test_a_signature_is_refused_for_lists_the_plan_does_not_take() -> None:
    plain = [torch.zeros(3, 4), torch.ones(5, dtype=torch.bfloat16)]
    assert torch_shim.signature(plain) is not None
    assert torch_shim.signature([]) == b""
    assert torch_shim.signature([*plain, torch.zeros(4, 3).t()]) is None  # not contiguous
    assert torch_shim.signature([*plain, torch.zeros(3).as_subclass(Sub)]) is None


@bound
def test_pointers_are_the_addresses_or_none_at_any_difference() -> None:
    tensors = [torch.randn(3, 4), torch.randn(6, dtype=torch.bfloat16), torch.tensor(2.0)]
    signature = torch_shim.signature(tensors)
    assert signature is not None
    found = torch_shim.pointers(tensors, signature)
    assert found is not None
    assert found.tolist() == [t.data_ptr() for t in tensors]
    # New tensors of the same facts (a training loop's next gradients): their addresses.
    fresh = [torch.empty_like(t) for t in tensors]
    found = torch_shim.pointers(fresh, signature)
    assert found is not None
    assert found.tolist() == [t.data_ptr() for t in fresh]
    differing = {
        "dtype": [tensors[0].double(), *tensors[1:]],
        "shape": [tensors[0].reshape(4, 3), *tensors[1:]],
        "rank": [tensors[0].reshape(12), *tensors[1:]],
        "not contiguous (same shape)": [torch.randn(4, 3).t(), *tensors[1:]],
        "subclass": [tensors[0].as_subclass(Sub), *tensors[1:]],
        "shorter": tensors[:2],
        "longer": [*tensors, torch.zeros(1)],
        "last one differs": [*tensors[:2], torch.tensor([2.0])],
    }
    for what, changed in differing.items():
        assert torch_shim.pointers(changed, signature) is None, what


@bound
def test_a_view_is_read_at_its_own_address() -> None:
    base = torch.randn(10, 8)
    views = [base[2:5], base[7]]
    signature = torch_shim.signature(views)
    assert signature is not None
    found = torch_shim.pointers(views, signature)
    assert found is not None
    assert found.tolist() == [base.data_ptr() + 16 * 4, base.data_ptr() + 56 * 4]


@pytest.mark.usefixtures("rebind")
@pytest.mark.skipif(_module is None, reason="the native extension is not built")
def test_nothing_is_bound_where_the_tensor_is_not_after_the_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _module is not None
    monkeypatch.setattr(torch_shim, "_word_after_header", lambda tensor: 0)
    torch_shim.bound.cache_clear()
    assert not torch_shim.bound()
    assert torch_shim.signature([torch.zeros(2)]) is None
    with pytest.raises(RuntimeError, match="not bound"):
        _module.shim_facts(torch.zeros(2))


@pytest.mark.usefixtures("rebind")
@pytest.mark.skipif(_module is None, reason="the native extension is not built")
def test_a_binding_whose_answers_differ_from_torchs_is_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _module is not None
    monkeypatch.setattr(torch_shim, "_answers_as_torch", lambda *args: False)
    torch_shim.bound.cache_clear()
    assert not torch_shim.bound()
    with pytest.raises(RuntimeError, match="not bound"):
        _module.shim_pointers([torch.zeros(2)], torch_shim.PLAIN, b"")


@pytest.mark.skipif(_module is None, reason="the native extension is not built")
def test_bind_shim_refuses_an_offset_in_the_header_and_null_functions() -> None:
    assert _module is not None
    with pytest.raises(ValueError, match="header"):
        _module.bind_shim(8, 0, *[1] * 8)
    with pytest.raises(ValueError, match="address is 0"):
        _module.bind_shim(object.__basicsize__, 0, *[1] * 7, 0)


@bound
def test_the_columns_of_in_memory_tensors_are_the_bindings() -> None:
    """``tensor_facts`` (the native kernel's columns for ``audit``) through the shim and
    through torch's binding, on runs of every kernel dtype broken by tensors it does not
    take as they are."""
    tensors = [
        *mixed().values(),
        torch.empty(3, 4, device="meta"),  # plain and contiguous, but not on the CPU
        torch.zeros(2, 1, 3, 1, 2, 1, 2),  # sizes past the 5 torch keeps inline
        torch.zeros(4, dtype=torch.int32),  # a dtype the kernel does not take
    ]
    plain = (torch.Tensor, torch.nn.Parameter)
    assert torch_shim.code_table(native.codes()) is not None
    module = _module
    assert module is not None
    through_shim = native.tensor_facts(tensors, native.codes(), plain)
    through_binding = module.tensor_facts(tensors, dict(native.codes()), plain)
    assert through_shim == through_binding
    assert through_shim[0][-3:] == b"\x00\x01\x00"
