# Exit status 0 (reward 1.0) when greeting.txt is exactly the line (a final newline is optional).
f="$WORK_DIR/greeting.txt"
[ -f "$f" ] && [ "$(cat "$f")" = "Hello, agent!" ]
