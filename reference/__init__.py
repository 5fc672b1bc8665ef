"""The PyTorch reference: `mso1.Reference` answers a request as the released `MSO1.ask_branch`
does (model.md §8.4); `questions` builds the published question sets (contract.md §10)."""
