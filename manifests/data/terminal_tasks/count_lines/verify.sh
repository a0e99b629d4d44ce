# Exit status 0 (reward 1.0) when count.txt holds 37, whitespace aside.
f="$WORK_DIR/count.txt"
[ -f "$f" ] && [ "$(tr -d '[:space:]' < "$f")" = "37" ]
