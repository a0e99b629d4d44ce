# Exit status 0 (reward 1.0) when count.txt holds 37, whitespace aside.
[ -f count.txt ] && [ "$(tr -d '[:space:]' < count.txt)" = "37" ]
