# A fresh random token per episode: replaying this task can never rebuild the same files.
od -An -tx1 -N16 /dev/urandom | tr -d ' \n' > token.txt
