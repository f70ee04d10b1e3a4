#include <infiniband/verbs.h>
#include <infiniband/driver.h>
#include <infiniband/mlx5dv.h>
#include <rdma/rdma_cma.h>
