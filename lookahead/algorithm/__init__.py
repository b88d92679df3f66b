"""The Lookahead algorithm, without any model code (nor torch).

A request's step, in the paper's terms:

1. `trie.NGramTrie` holds token n-grams: the request's prompt in a trie of its own, everything
   the instance generated before in a shared, bounded one; `spans.SpanIndex` finds the longest
   earlier repeat of the request's latest tokens (a verbatim copy).
2. `retrieval.retrieve_draft` turns the last few tokens into a draft tree (`draft.Draft`: tokens,
   parents, the probability of reaching each node): hierarchical (`hier`), parallel branches
   (`par`) or one branch (`one`). It is the trie drafter (`drafters.TrieDrafter`), one behind the
   `drafters.Drafter` protocol, which a request chooses by name (LookaheadConfig.drafter).
3. `planner.plan_step` keeps, for the whole batch, the draft width whose expected accepted tokens
   pay best for the forward's measured cost.
4. The model scores the whole tree in one forward (the runtime's job); `verify.verify` keeps the
   longest branch the model agrees with, plus one bonus token.
"""
