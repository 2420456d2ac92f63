"""The audit and the step-boundary watch: the criterion, the repair, the schedule and the memory trigger."""
