#!/usr/bin/env python3
"""State dicts in torch.save's zip format made and compared without torch (or with it, when it is
importable), for tests/cli_torch_interop.sh. Independent of launch/moeut-torch: files are
written by Python's own pickle (stand-in `torch` classes, protocol 2 as torch.save uses) and
read by an unpickler of its own; names and shapes come from a weights file moeut-train wrote.

  torch_state_dicts.py make WEIGHTS.h5 OUT.pt ARGS.json [--bf16] [--wrap] [--break KIND]
  torch_state_dicts.py same A.pt B.pt         # same names, dtypes, shapes and bits
  torch_state_dicts.py same_h5 A.h5 B.h5      # same datasets (values, shapes) and root attributes
"""
import collections
import io
import json
import pickle
import sys
import types
import zipfile

import h5py
import numpy as np


class StandIn:
    """What the pickler writes in place of a torch class or function: a global reference."""

    def __init__(self, module, name):
        self.module, self.name = module, name


def stand_in_modules():
    """Registers `torch` and `torch._utils` stand-ins so that pickle can name their globals."""
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")
    for module, name in (("torch", "FloatStorage"), ("torch", "BFloat16Storage"), ("torch", "LongStorage"),
                         ("torch._utils", "_rebuild_tensor_v2")):
        cls = type(name, (), {"__module__": module, "__qualname__": name})
        setattr(torch if module == "torch" else utils, name, cls)
    torch._utils = utils
    sys.modules.setdefault("torch", torch)
    sys.modules.setdefault("torch._utils", utils)
    return torch, utils


class FakeStorage:
    def __init__(self, key, cls, numel):
        self.key, self.cls, self.numel = key, cls, numel


class FakeTensor:
    def __init__(self, storage, shape):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        return (sys.modules["torch._utils"]._rebuild_tensor_v2,
                (self.storage, 0, tuple(self.shape), stride, False, collections.OrderedDict()))


class Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, FakeStorage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def save(path, tensors):
    """tensors: name -> (storage class name, numpy array)."""
    torch, _ = stand_in_modules()
    fakes = collections.OrderedDict()
    for i, (name, (storage, array)) in enumerate(tensors.items()):
        fakes[name] = FakeTensor(FakeStorage(str(i), getattr(torch, storage), int(array.size)), list(array.shape))
    data = io.BytesIO()
    Pickler(data, protocol=2).dump(fakes if not WRAP else {"model": fakes, "step": 7})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("sd/data.pkl", data.getvalue())
        for i, (_, array) in enumerate(tensors.values()):
            z.writestr(f"sd/data/{i}", np.ascontiguousarray(array).tobytes())
        z.writestr("sd/version", "3\n")


class Unpickler(pickle.Unpickler):
    def __init__(self, z, prefix):
        super().__init__(io.BytesIO(z.read(prefix + "data.pkl")))
        self.z, self.prefix = z, prefix

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, shape, stride, *rest: (storage[0], storage[1][offset:offset + int(
                np.prod(shape))].reshape(shape))
        if module == "torch" and name in ("FloatStorage", "BFloat16Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        dtype = "<f4" if pid[1] == "FloatStorage" else "<u2"
        return pid[1], np.frombuffer(self.z.read(f"{self.prefix}data/{pid[2]}"), dtype=dtype)


def load(path):
    try:
        import torch
        sd = torch.load(path, map_location="cpu", weights_only=True)
        sd = sd.get("model", sd)
        return {k: (str(v.dtype), (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy()) for k, v in
                sd.items()}
    except ImportError:
        pass
    with zipfile.ZipFile(path) as z:
        prefix = next(n for n in z.namelist() if n.endswith("data.pkl"))[: -len("data.pkl")]
        sd = Unpickler(z, prefix).load()
    return sd.get("model", sd)


def make(weights, out, args_out, bf16, brk):
    rng = np.random.default_rng(5)
    with h5py.File(weights, "r") as f:
        shapes = {name: f[name].shape for name in f}
        args = {k: (int(v) if np.issubdtype(type(v), np.integer) else float(v)) for k, v in f.attrs.items()}
    tensors = collections.OrderedDict()
    for name, shape in shapes.items():
        values = rng.normal(0, 0.05, shape).astype(np.float32)
        if bf16:
            tensors[name] = ("BFloat16Storage", (values.view(np.uint32) >> 16).astype(np.uint16))
        else:
            tensors[name] = ("FloatStorage", values)
    first = next(iter(shapes))
    if brk == "missing":
        del tensors[first]
    elif brk == "extra":
        tensors["transformer.layers.9.ffn.keys"] = tensors[first]
    elif brk == "shape":
        tensors[first] = ("FloatStorage", np.zeros([2] + list(shapes[first]), np.float32))
    elif brk == "nan":
        tensors[first][1].flat[3] = np.nan
    elif brk == "dtype":
        tensors[first] = ("LongStorage", np.zeros(shapes[first], np.int64))
    elif brk == "att_n_experts":
        args["att_n_experts"], args["att_k"] = 1, 1
    save(out, tensors)
    with open(args_out, "w") as f:
        json.dump(args, f)


def same(a, b):
    x, y = load(a), load(b)
    assert list(x) == list(y) or sorted(x) == sorted(y), f"names differ: {sorted(set(x) ^ set(y))}"
    for name in x:
        assert x[name][0] == y[name][0] or {x[name][0], y[name][0]} <= {"FloatStorage", "torch.float32"} or \
            {x[name][0], y[name][0]} <= {"BFloat16Storage", "torch.bfloat16"}, f"{name}: {x[name][0]} {y[name][0]}"
        assert x[name][1].shape == y[name][1].shape, f"{name}: shapes {x[name][1].shape} {y[name][1].shape}"
        assert x[name][1].tobytes() == y[name][1].tobytes(), f"{name}: bits differ"
    print(f"same: {len(x)} tensors bit-identical")


def same_h5(a, b):
    with h5py.File(a, "r") as f, h5py.File(b, "r") as g:
        assert sorted(f) == sorted(g), f"datasets differ: {sorted(set(f) ^ set(g))}"
        assert dict(f.attrs) == dict(g.attrs), f"attributes differ: {dict(f.attrs)} {dict(g.attrs)}"
        for name in f:
            assert f[name].dtype == g[name].dtype == np.float32, name
            assert np.array_equal(f[name][()], g[name][()]), f"{name}: values differ"
        print(f"same_h5: {len(f)} datasets equal")


WRAP = "--wrap" in sys.argv
if __name__ == "__main__":
    cmd, rest = sys.argv[1], [a for a in sys.argv[2:] if a not in ("--bf16", "--wrap")]
    if cmd == "make":
        brk = rest[rest.index("--break") + 1] if "--break" in rest else None
        make(rest[0], rest[1], rest[2], "--bf16" in sys.argv, brk)
    elif cmd == "same":
        same(*rest)
    else:
        same_h5(*rest)
