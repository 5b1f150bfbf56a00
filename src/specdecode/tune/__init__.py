"""`specdecode tune`: measure this machine's costs and each drafter's acceptance, pick options, save a profile."""
