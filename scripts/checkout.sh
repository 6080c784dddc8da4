# Sourced by the README's commands (test.sh, demo.sh): they must leave the checkout as they
# found it (whatever they generate is git-ignored).
#   before="$(checkout_state)"; ...; checkout_unchanged demo.sh "$before"

checkout_state() {
    git status --porcelain 2>/dev/null || true
}

# Fails (exit 1) naming the script when the checkout differs from `before`.
checkout_unchanged() {
    local after
    after="$(checkout_state)"
    if [ "$2" != "$after" ]; then
        echo "$1: the run changed the checkout (git status before and after differ):" >&2
        diff <(echo "$2") <(echo "$after") >&2 || true
        exit 1
    fi
}
