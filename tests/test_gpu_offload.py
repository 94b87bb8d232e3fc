"""The GPU install path as far as this engine sees it: ggml's backend devices reported in INFO and
/props with the layers offloaded, and the device options classified by what the installed
llama.cpp build supports.

Run here on the CPU build (nothing offloaded, the device options without effect); the same tests
assert the offload and the applied options where a GPU build is installed (``gpu_backend()``)."""
from __future__ import annotations

import ctypes

import pytest

from codec.enums import Op
from engine.gpu import BackendDevice, backend_devices, gpu_backend, layers_offloaded, offload_devices, registry_for
from engine.model_params import ModelParams
from engine.params_table import GPU_LAYERS_ALL
from hydra_rpc.cli import llama_args
from hydra_rpc.cli.llama_args import APPLIED, BY_NAME, GPU_APPLIED, NO_EFFECT, status
from hydra_rpc.cli.llama_argv import parse_llama_argv
from hydra_rpc.cli.llama_cli import model_params

GPU = gpu_backend()
SERVER_ARGS = ("--model", "tiny", "--parallel", "1", "--threads", "1", "--n-gpu-layers", "all",
               "--log-level", "WARNING")
pytestmark = pytest.mark.timeout(120)

CPU = BackendDevice("CPU", "x86", "CPU", "CPU")
CUDA0, CUDA1 = BackendDevice("CUDA0", "RTX A", "GPU", "CUDA"), BackendDevice("CUDA1", "RTX B", "GPU", "CUDA")
IGPU = BackendDevice("Vulkan0", "iGPU", "IGPU", "Vulkan")
RPC0 = BackendDevice("RPC0", "10.0.0.2:50052", "GPU", "RPC")


# ---- the registry and llama.cpp's offload rule --------------------------------------------------

def test_registry_lists_the_cpu_and_says_whether_a_gpu_backend_is_there():
    devs = backend_devices()
    assert any(d.type == "CPU" for d in devs) and all(d.name and d.backend for d in devs)
    assert GPU == any(d.type in ("GPU", "IGPU") and not d.is_rpc for d in devs)


def test_offload_devices_follow_llama_cpps_choice():
    assert offload_devices([CPU]) == ()  # a CPU build: nowhere to offload
    assert offload_devices([CPU, CUDA0, RPC0, CUDA1]) == (RPC0, CUDA0, CUDA1)  # RPC first
    assert offload_devices([CPU, IGPU]) == (IGPU,)  # an integrated GPU only without a discrete one
    assert offload_devices([CPU, IGPU, CUDA0]) == (CUDA0,)
    assert offload_devices([CPU, CUDA0, CUDA1], split_mode="none", main_gpu=1) == (CUDA1,)
    assert offload_devices([CPU, CUDA0, CUDA1], names=["CUDA1"]) == (CUDA1,)
    assert offload_devices([CPU, CUDA0], names=["none"]) == ()
    assert registry_for([], [CPU, RPC0, CUDA0]) == (CPU, CUDA0)  # a dropped ggml-RPC server
    assert registry_for(["10.0.0.2:50052"], [CPU, RPC0]) == (CPU, RPC0)


def test_layers_offloaded_is_llama_cpps_act_gpu_layers():
    assert layers_offloaded(-1, 24, 0) == 0  # no device: nothing, whatever was asked
    assert layers_offloaded(-1, 24, 1) == 25  # all: the repeating layers and the output layer
    assert layers_offloaded(10, 24, 2) == 10 and layers_offloaded(99, 24, 1) == 25


# ---- the device options: applied with a GPU backend, explained without one -----------------------

@pytest.mark.parametrize("name", sorted(GPU_APPLIED))
def test_device_options_are_classified_by_the_build(name):
    arg = BY_NAME[name][0]
    assert status(arg, gpu=True) == (APPLIED, GPU_APPLIED[name])
    label, reason = status(arg, gpu=False)
    assert label == NO_EFFECT and "no GPU backend" in reason
    assert status(arg) == status(arg, gpu=GPU)  # the installed build decides
    assert name not in {*llama_args._APPLIED, *llama_args._NO_EFFECT, *llama_args._REFUSED}


def test_device_options_reach_the_settings_or_the_ignored_list():
    s = parse_llama_argv(["--model", "m.gguf", "--split-mode", "row", "--tensor-split", "3,1", "--main-gpu", "1",
                          "--device", "CUDA0,CUDA1"], env={})
    ignored = {a.name for a in s.ignored_args}
    if GPU:
        assert (s.split_mode, s.tensor_split, s.main_gpu, s.devices) == ("row", (3.0, 1.0), 1, ("CUDA0", "CUDA1"))
        p = model_params(s, "m.gguf")
        assert (p.split_mode, p.tensor_split, p.main_gpu, p.devices) == ("row", (3.0, 1.0), 1, ("CUDA0", "CUDA1"))
        assert not ignored & set(GPU_APPLIED)
    else:
        assert (s.split_mode, s.tensor_split, s.main_gpu, s.devices) == ("layer", (), 0, ())
        assert ignored >= {"--split-mode", "--tensor-split", "--main-gpu", "--device"}
        assert all("no GPU backend" in a.reason for a in s.ignored_args if a.name in GPU_APPLIED)


def test_configure_split_mode_is_staged_only_with_a_gpu_backend():
    from engine.tiers import classify

    out = classify({"split_mode": "row", "tensor_split": "1/1"})
    if GPU:
        assert out.staged == {"split_mode": "row", "tensor_split": (1.0, 1.0)} and out.tier == "T3"
    else:
        assert set(out.rejected_keys) == {"split_mode", "tensor_split"} and not out.staged
        assert all("no GPU backend" in r for r in out.rejected_keys.values())


def test_model_fields_offload_only_where_there_is_somewhere_to_offload():
    pytest.importorskip("llama_cpp")
    from engine.llama_backend.build import LlamaBackendError, model_fields

    p = ModelParams("m.gguf", n_gpu_layers=GPU_LAYERS_ALL, split_mode="row", main_gpu=0, tensor_split=(3.0, 1.0),
                    devices=("CPU",))
    cpu = model_fields(p, gpu=False)
    assert cpu["n_gpu_layers"] == 0 and not {"split_mode", "main_gpu", "tensor_split", "devices"} & cpu.keys()
    assert model_fields(ModelParams("m.gguf", rpc_servers=("127.0.0.1:1",)), gpu=False)["n_gpu_layers"] == -1
    gpu = model_fields(p, gpu=True)
    assert gpu["n_gpu_layers"] == -1 and gpu["split_mode"] == 2 and gpu["main_gpu"] == 0
    assert gpu["tensor_split"][0] == 3.0 and gpu["tensor_split"][1] == 1.0
    devs = ctypes.cast(gpu["devices"], ctypes.POINTER(ctypes.c_void_p))
    assert devs[0] and not devs[1]  # CPU, then the NULL that ends llama.cpp's list
    none = model_fields(ModelParams("m.gguf", devices=("none",)), gpu=True)
    assert not ctypes.cast(none["devices"], ctypes.POINTER(ctypes.c_void_p))[0]
    with pytest.raises(LlamaBackendError, match="invalid device: NOPE0"):
        model_fields(ModelParams("m.gguf", devices=("NOPE0",)), gpu=True)


# ---- INFO and /props report the devices and the layers offloaded ---------------------------------

def _check_offload(meta: dict) -> None:
    devs = meta["backend_devices"]
    assert any(d["type"] == "CPU" for d in devs) and all({"name", "description", "type", "backend"} <= d.keys()
                                                          for d in devs)
    off = meta["gpu_offload"]
    assert off["n_gpu_layers"] == "all" and off["gpu_backend"] is GPU and off["n_layers"] > 1
    if GPU:  # a GPU build: every layer and the output layer on the GPU
        assert off["n_layers_offloaded"] == off["n_layers"] and off["n_gpu_layers_applied"] == -1
        assert off["devices"] and any(d["type"] in ("GPU", "IGPU") for d in devs)
        assert set(off["devices"]) <= set(meta["devices"])
    else:  # the CPU build: nowhere to offload, nothing offloaded, and INFO says so
        assert off["n_layers_offloaded"] == 0 and off["n_gpu_layers_applied"] == 0 and off["devices"] == []
        assert meta["devices"] == ["CPU"]


@pytest.mark.asyncio
async def test_info_reports_backend_devices_and_layers_offloaded(client):
    meta = (await client.request(Op.INFO)).meta
    _check_offload(meta)
    assert meta["split_mode"] == ("layer" if GPU else "none")


@pytest.mark.asyncio
async def test_props_reports_the_same(http, client):
    async with http.get("/props") as r:
        assert r.status == 200
        props = await r.json()
    assert props["n_gpu_layers"] == "all"
    _check_offload(props)
    info = (await client.request(Op.INFO)).meta
    assert props["gpu_offload"] == info["gpu_offload"] and props["backend_devices"] == info["backend_devices"]
