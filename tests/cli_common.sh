# Sourced by the CLI tests: a small corpus made into token files, the small model's options,
# the step losses of a metrics file, and the Python that draws plots.

# tiny_text FILE: 2000 deterministic sentences over a 16-word vocabulary, with some order to learn.
tiny_text() {
  awk 'BEGIN { srand(7); split("the a cat dog sees chases big small red blue runs sleeps on under mat tree", w, " ");
               for (i = 0; i < 2000; i++) { n = 4 + int(rand() * 6); s = "";
                 for (j = 0; j < n; j++) s = s (j ? " " : "") w[1 + (i * 3 + j * 5 + int(rand() * 3)) % 16];
                 print s "." } }' > "$1"
}

# tiny_corpus BIN_DIR WORK_DIR: tiny_text in WORK_DIR/text.txt, prepared into WORK_DIR/data
# (vocabulary 48).
tiny_corpus() {
  tiny_text "$2/text.txt"
  "$1/moeut-prepare-data" --input "$2/text.txt" --out_dir "$2/data" --vocab_size 48 --threads 1 > /dev/null
}

# fresh_corpus BIN_DIR WORK_DIR: WORK_DIR emptied, then tiny_corpus in it.
fresh_corpus() {
  rm -rf "$2" && mkdir -p "$2"
  tiny_corpus "$1" "$2"
}

fail() { echo "FAIL: $*"; exit 1; }

# The small model the CLI tests train (configs/tiny.cfg cut down), on tiny_corpus's data.
small_model=(--config "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/configs/tiny.cfg" --n_tokens 48 --d_model 32 --n_heads 2
             --d_head 16 --ff_n_experts 8 --ff_k 2 --ff_expert_size 16 --context 32)

# losses METRICS: "step loss" of each training step.
losses() { sed -n 's/^{"step": \([0-9]*\), "loss": \([^,]*\),.*/\1 \2/p' "$1"; }

# The interpreter with matplotlib (Debian's python3-matplotlib), else the first python3.
python=python3
for p in /usr/bin/python3 python3; do "$p" -c "import matplotlib" 2> /dev/null && { python=$p; break; }; done

# is_png FILE: the file starts with PNG's signature.
is_png() { [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; }
