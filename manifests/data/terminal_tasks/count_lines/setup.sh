# 37 deterministic lines: the same file in every episode, so replays agree.
for i in $(seq 1 37); do echo "word-$i"; done > data.txt
