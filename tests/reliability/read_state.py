"""Reads every muond state file of a directory with Python's safetensors
(the files must stay plain safetensors with a JSON metadata
header). Usage: read_state.py DIR JOB. Prints 'N files ok'."""
import glob
import json
import os
import sys

from safetensors import safe_open


def main(directory, job):
    files = sorted(glob.glob(os.path.join(directory, "rank*.safetensors")))
    for path in files:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata()
            assert meta["format"] == "muond-state-v1", meta
            assert meta["job_id"] == job, meta
            rank = int(meta["rank"])
            assert path.endswith(f"rank{rank}.safetensors"), (path, rank)
            assert int(meta["step_id"]) >= 0, meta
            domains = json.loads(meta["domains"])
            hyper = json.loads(meta["hyperparameters"])
            d = domains["muon"]
            assert (d["g"], d["t"]) == divmod(rank, d["tp_size"]), d
            assert hyper["muon"]["algorithm"] == "muon", hyper
            keys = list(f.keys())
            assert keys, path
            for k in keys:  # "<group>/<param>/g<g>t<t>/<momentum|exp_avg|...>"
                group, param, coords, kind = k.split("/")
                assert group in domains and kind == "momentum", k
                assert coords == f"g{d['g']}t{d['t']}", k
                t = f.get_tensor(k)
                assert str(t.dtype) == "float32", (k, t.dtype)
    print(f"{len(files)} files ok")
    return 0 if len(files) > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
