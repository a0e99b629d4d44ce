# Partial credit: the fraction of the four directories that exist, written to $REWARD_FILE.
found=0
for dir in project/src project/tests project/docs project/data/raw; do
    [ -d "$WORK_DIR/$dir" ] && found=$((found + 1))
done
echo "$found of 4 directories exist"
awk -v n="$found" 'BEGIN { print n / 4 }' > "$REWARD_FILE"
