# Exit status 0 (reward 1.0) when greeting.txt is exactly the line (a final newline is optional).
[ -f greeting.txt ] && [ "$(cat greeting.txt)" = "Hello, agent!" ]
