"""What guards a record: stores, the loss contract, @forward_step and its argument and result shapes."""
