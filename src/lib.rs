//! kvferry facade
