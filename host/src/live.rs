//! A value a configuration reload replaces while work keeps going: readers take the version in
//! effect (an `Arc`) and keep it as long as they need, so a delivery started before a reload
//! finishes with what it started with.

use std::sync::{Arc, RwLock};

/// The version of `T` in effect; [`Live::set`] makes a new one take effect for later readers.
#[derive(Debug)]
pub struct Live<T>(RwLock<Arc<T>>);

impl<T> Live<T> {
    pub fn new(value: Arc<T>) -> Self {
        Live(RwLock::new(value))
    }

    /// The version in effect now.
    pub fn get(&self) -> Arc<T> {
        // The lock only guards an `Arc` swap, which cannot leave it half-written.
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Puts `value` in effect; readers holding the previous version keep it.
    pub fn set(&self, value: Arc<T>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = value;
    }
}
