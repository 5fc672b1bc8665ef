"""The PyTorch reference: `mso1.Reference` answers a request as the released `MSO1.ask_branch`
does (docs/model.md §8.4); `questions` builds the published question sets (docs/contract.md §10)."""
