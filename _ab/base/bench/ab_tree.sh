#!/usr/bin/env bash
# A commit's source tree for bench/ab_commit.py --base, small enough to travel to the GPU machine with the working
# tree (the device takes 64 MiB in all): the product, bench/ and pyproject.toml, without bench/runs and the
# tokenizer / model assets (random-weight runs need neither). Put it in an untracked folder, e.g.
#   bash bench/ab_tree.sh 48eef77 _ab/48eef77 && python bench/ab_commit.py --base $PWD/_ab/48eef77 ...
set -euo pipefail
commit=${1:?usage: ab_tree.sh COMMIT DIR}; dir=${2:?usage: ab_tree.sh COMMIT DIR}
rm -rf "$dir" && mkdir -p "$dir"
git archive "$commit" qwen35_jax pallas_kernels bench pyproject.toml | tar -x -C "$dir"
rm -rf "$dir/bench/runs" "$dir/qwen35_jax/assets"
du -sh "$dir"
