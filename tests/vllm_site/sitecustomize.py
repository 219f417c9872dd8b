"""Test-only code loaded into a vLLM server's processes (its folder on PYTHONPATH): an
independent path to the KV that vLLM writes, and a way to take a kvdiag hook away.

``KVDIAG_TEST_KV_DUMP=DIR``: every key and value row vLLM's CPU attention backend writes into
its cache (``do_kv_cache_update``, by slot) is kept; on each decode step of a single request,
the request's K/V per layer (the rows of its slots, in block-table order), its query, the
backend's scale, the process id and each layer's KV cache tensor bytes are saved to
``DIR/step-<seq_len>.pt``, for the first ``KVDIAG_TEST_KV_DUMP_STEPS`` (3) decode steps; then it
stops. Nothing here reads the cache tensor through kvdiag's code or layout.

``KVDIAG_TEST_HIDE_HOOK=1``: ``GPUModelRunner.execute_model`` is replaced by a pass-through
without named parameters, so that kvdiag's signature check skips its worker hook.
"""

import importlib.abc
import importlib.util
import os
import re
import sys

DUMP = os.environ.get("KVDIAG_TEST_KV_DUMP")
MAX_STEPS = int(os.environ.get("KVDIAG_TEST_KV_DUMP_STEPS", "3"))
HIDE = os.environ.get("KVDIAG_TEST_HIDE_HOOK") == "1"
TARGETS = {"vllm.v1.attention.backends.cpu_attn", "vllm.v1.worker.gpu_model_runner"}


def _patch_cpu_attn(module):
    import torch

    impl = module.CPUAttentionBackendImpl
    update, forward = impl.do_kv_cache_update, impl.forward
    written = {}  # layer -> slot -> (k [H, D], v [H, D])
    steps = {}  # seq_len -> {"layers": {...}}
    saved = []

    def index_of(name):
        return int(re.search(r"layers\.(\d+)\.", name).group(1))

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        out = update(self, layer, key, value, kv_cache, slot_mapping)
        if len(saved) >= MAX_STEPS:
            return out
        rows = written.setdefault(index_of(layer.layer_name), {})
        for i, slot in enumerate(slot_mapping[: key.shape[0]].tolist()):
            if slot >= 0:
                rows[slot] = (key[i].detach().clone(), value[i].detach().clone())
        return out

    def fwd(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        out = forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if len(saved) >= MAX_STEPS or attn_metadata is None or attn_metadata.max_query_len != 1 or attn_metadata.seq_lens.shape[0] != 1:
            return out
        seq_len = int(attn_metadata.seq_lens[0])
        block = kv_cache.shape[2]
        table = attn_metadata.block_table[0].tolist()
        rows = written[index_of(layer.layer_name)]
        kv = [rows[table[i // block] * block + i % block] for i in range(seq_len)]
        k = torch.stack([r[0] for r in kv], dim=1)  # [H, T, D]
        v = torch.stack([r[1] for r in kv], dim=1)
        step = steps.setdefault(seq_len, {"layers": {}, "pid": os.getpid(), "scale": float(self.scale),
                                          "kv_bytes": {}})
        step["layers"][index_of(layer.layer_name)] = (query[0].detach().clone(), k, v)
        step["kv_bytes"][index_of(layer.layer_name)] = kv_cache.numel() * kv_cache.element_size()
        if len(step["layers"]) == len(written):
            torch.save(step, os.path.join(DUMP, f"step-{seq_len}.pt"))
            steps.pop(seq_len)
            saved.append(seq_len)
            if len(saved) >= MAX_STEPS:
                written.clear()
        return out

    impl.do_kv_cache_update, impl.forward = do_kv_cache_update, fwd


def _patch_runner(module):
    cls = module.GPUModelRunner
    original = cls.execute_model

    def execute_model(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    cls.execute_model = execute_model


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            if name.endswith("cpu_attn") and DUMP:
                _patch_cpu_attn(module)
            if name.endswith("gpu_model_runner") and HIDE:
                _patch_runner(module)
        spec.loader.exec_module = run
        return spec


if DUMP or HIDE:
    sys.meta_path.insert(0, _Finder())
