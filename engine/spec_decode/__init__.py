"""Speculative decoding, in the shape of vLLM's speculative_config.

    config.py             its settings (method ngram or draft_model,
                          num_speculative_tokens), frozen and validated
    proposer.py           the Proposer the config names
    ngram.py              prompt lookup: each request's n-grams indexed as its tokens
                          arrive, so a proposal is a few dictionary lookups
    draft_model.py        a smaller model sharing the tokenizer, greedy drafts; its
                          KV in its own cache under the target's block ids, computed
                          where the request decodes
    rejection_sampler.py  verify: drafts kept while they equal the target's token,
                          drawn as plain decoding draws it; rejection_sample: vLLM's
                          rule for drafts sampled from q
"""
