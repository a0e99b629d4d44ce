[ -s "$WORK_DIR/token.txt" ]
