// The consumer program compiled by nvcc: both backends.
#include "main.cpp"
