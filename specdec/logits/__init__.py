"""What a request's sampling options do to the target's logits, and the log-probabilities it
gets back.

    processors.py   RequestLogits: one request's logit_bias, penalties and bans (min_tokens,
                    bad_words, structured output) applied to its verification rows, each row
                    along its draft-tree path; kept up to date with the request's output
    grammar.py      structured output with llguidance: the request's matcher, the allowed tokens
                    at every node of a draft tree, and the drafts it prunes before the forward
    logprobs.py     the target's log-softmax of each emitted (or prompt) token, and
                    the top alternatives, from the raw verification rows

Losslessness: a tree node's row is processed exactly as plain decoding would process the row
of that position after the node's path had been emitted (the same integer counts, the same float
operations), so a verifier accepting against the processed rows emits what plain decoding of the
processed distribution emits. Drafts the grammar forbids are pruned before the forward (the
target would reject them anyway).
"""
