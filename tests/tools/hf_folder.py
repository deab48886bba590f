"""A Hugging Face model folder read as its readers read it (the crash tests
of exports): its files, and its tensors through the real `safetensors`
package, model.safetensors first (transformers prefers it), else the files
the index names."""
import json
import os


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def folder_files(folder):
    """{name: bytes} of the regular files of a folder, and the names of its other entries."""
    files, others = {}, []
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if os.path.isfile(full) and not os.path.islink(full):
            files[name] = read_bytes(full)
        else:
            others.append(name)
    return files, others


def load_weights(folder):
    """What a reader loads from a folder, with the real safetensors package: model.safetensors when it is
    there (transformers prefers it), else the files model.safetensors.index.json names, each tensor from
    the file the index maps it to. Returns ({name: ndarray}, None) or (None, the error)."""
    from safetensors.numpy import load_file
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    try:
        if os.path.exists(single):
            return load_file(single), None
        if not os.path.exists(index):
            return None, "neither model.safetensors nor model.safetensors.index.json"
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        shards = {name: load_file(os.path.join(folder, name)) for name in sorted(set(weight_map.values()))}
        out = {}
        for tensor, name in weight_map.items():
            if tensor not in shards[name]:
                return None, "%s: the index maps %s to it; it does not hold it" % (name, tensor)
            out[tensor] = shards[name][tensor]
        return out, None
    except Exception as e:  # noqa: BLE001 -- any error is a refusal, which is what a mix should get
        return None, "%s: %s" % (type(e).__name__, e)


def same_tensors(a, b):
    if sorted(a) != sorted(b):
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
               for k in a)
