"""Backend selection: platform priority, env-var overrides, loud failures, caching."""

import pytest
import torch

import kvmulti
from kvmulti.backends import (ENV_BACKEND, ENV_DRAFT_BACKEND, AttentionConfig, BackendSelectionError,
                              get_backend, select_backend)
from kvmulti.backends.base import Backend
from kvmulti.backends.registry import backend_names, dispatch_order

CONFIG = AttentionConfig.from_layout(kvmulti.KVCacheLayout(4, 16, 2, 64, dtype=torch.float16), "cpu")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_DRAFT_BACKEND, raising=False)


def test_priority_lists_match_design():
    orders = {platform: dispatch_order(platform) for platform in ("rocm", "xpu", "cuda", "cpu")}
    assert orders == {"rocm": ("HIP", "TRITON"), "xpu": ("SYCL", "TRITON"), "cuda": ("TRITON",), "cpu": ("CPU",)}


def test_cpu_host_picks_cpu_for_both_roles():
    assert select_backend(CONFIG) == "CPU"
    assert select_backend(CONFIG, role="draft") == "CPU"


def test_env_override_is_case_insensitive(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "cpu")
    assert select_backend(CONFIG) == "CPU"


@pytest.mark.parametrize("var", [ENV_BACKEND, ENV_DRAFT_BACKEND])
def test_unknown_env_name_fails_loudly(monkeypatch, var):
    monkeypatch.setenv(var, "FLASHINFER")
    with pytest.raises(ValueError, match=f"{var}='FLASHINFER' is not a kvmulti backend; valid names: {', '.join(backend_names())}"):
        select_backend(CONFIG, role="draft")


def test_draft_variable_applies_to_draft_only(monkeypatch):
    monkeypatch.setenv(ENV_DRAFT_BACKEND, "NOPE")
    assert select_backend(CONFIG, role="target") == "CPU"        # the target never reads the draft variable
    with pytest.raises(ValueError, match=ENV_DRAFT_BACKEND):
        select_backend(CONFIG, role="draft")


def test_draft_variable_takes_precedence_for_draft(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "NOPE")
    monkeypatch.setenv(ENV_DRAFT_BACKEND, "CPU")
    assert select_backend(CONFIG, role="draft") == "CPU"
    with pytest.raises(ValueError, match=ENV_BACKEND):
        select_backend(CONFIG, role="target")


def test_forced_backend_that_cannot_serve_lists_reasons():
    gpu_config = AttentionConfig(**{**CONFIG.__dict__, "platform": "cuda"})
    with pytest.raises(BackendSelectionError, match="backend=CPU cannot serve cuda .*CPU runs on cpu, not cuda"):
        select_backend(gpu_config, requested="CPU")


def test_forced_by_env_that_cannot_serve_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "CPU")
    gpu_config = AttentionConfig(**{**CONFIG.__dict__, "platform": "cuda"})
    with pytest.raises(BackendSelectionError, match=f"{ENV_BACKEND}=CPU cannot serve"):
        select_backend(gpu_config)


def test_gpu_tensor_never_goes_to_cpu_backend():
    rocm = AttentionConfig(**{**CONFIG.__dict__, "platform": "rocm"})
    try:
        name = select_backend(rocm)
    except BackendSelectionError as e:
        assert "HIP" in str(e) and "TRITON" in str(e)
    else:
        assert name in ("HIP", "TRITON")


def test_capability_reasons_are_declared():
    class Narrow(Backend):
        name, platforms = "NARROW", ("cpu",)
        dtypes, head_sizes, max_block_size = (torch.float16,), (64, 128), 32
        supports_softcap = False

        def write_kv(self, *a): ...
        def paged_attention(self, *a): ...

    cfg = AttentionConfig("cpu", torch.float32, 80, 80, 2, 64, "NHD", softcap=True)
    reasons = Narrow().not_supported_reasons(cfg)
    assert any("dtype torch.float32" in r for r in reasons)
    assert any("head_size 80" in r for r in reasons)
    assert any("block_size 64" in r for r in reasons)
    assert any("softcap" in r for r in reasons)


def test_available_backends_reports_reasons():
    avail = kvmulti.available_backends("cpu")
    assert set(avail) == set(backend_names()) >= {"HIP", "SYCL", "TRITON", "CPU", "IPEX"} and avail["CPU"] == []
    for name, reasons in avail.items():
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons)


def test_selection_is_cached():
    from kvmulti.backends.registry import _select_cached
    _select_cached.cache_clear()
    select_backend(CONFIG)
    select_backend(CONFIG)
    assert _select_cached.cache_info().hits >= 1


def test_get_backend_singleton():
    assert get_backend("cpu") is get_backend("CPU")
