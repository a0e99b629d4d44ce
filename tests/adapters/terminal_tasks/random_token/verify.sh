[ -s token.txt ]
